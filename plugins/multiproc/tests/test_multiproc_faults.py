"""Faults: killed workers, a killed driver, Ctrl-C, failed start-up, timeouts, shutdown.

Each fault test runs several times (``repeat``) to catch flakiness.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import Future
from typing import Any

import psutil
import pytest
from mp_test_helpers import shm_unchanged, wait_gone

from executor_core import (
    ExecutorClosedError,
    ExecutorError,
    ExecutorFailedError,
    ExecutorState,
    RecoveryPolicy,
    RPCTimeoutError,
    WorkerDiedError,
    WorkerError,
    create_executor,
)
from executor_core.testing import conformance_config

__all__ = ["shm_unchanged"]  # the fixture, imported for the tests below

REPEATS = 3
FAST_STOP = {"shutdown_grace_s": 1.0}


def make(**overrides: Any) -> Any:
    overrides.setdefault("backend_options", FAST_STOP)
    return create_executor(conformance_config("mp", world_size=2, **overrides))


def worker_pids(executor: Any) -> list[int]:
    pids: list[int] = executor.collective_rpc("get_pid")
    return pids


# --- a worker dies ---------------------------------------------------------------------


@pytest.mark.parametrize("repeat", range(REPEATS))
@pytest.mark.usefixtures("shm_unchanged")
def test_worker_killed_during_long_call(repeat: int) -> None:
    executor = make()
    try:
        pids = worker_pids(executor)
        failures: list[ExecutorFailedError] = []
        executor.register_failure_callback(failures.append)
        pending = executor.collective_rpc("slow", args=(30.0,), non_block=True)
        time.sleep(0.2)  # the call is running in both workers
        victim = 1
        killed_at = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL)
        with pytest.raises(WorkerDiedError) as info:
            pending.result(timeout=5)
        assert time.monotonic() - killed_at < 1.0
        assert info.value.rank == victim
        assert info.value.signal == signal.SIGKILL
        assert f"rank {victim}" in str(info.value)
        # Later calls fail the same way, at once.
        with pytest.raises(WorkerDiedError):
            executor.collective_rpc("get_rank")
        assert executor.is_failed
        # The survivor is terminated (it was busy in a 30 s call) after the grace period.
        assert wait_gone(pids, 5.0) == []
        assert len(failures) == 1
        assert failures[0] is executor.failure
    finally:
        executor.shutdown()
    assert len(failures) == 1


@pytest.mark.parametrize("repeat", range(REPEATS))
@pytest.mark.usefixtures("shm_unchanged")
def test_worker_killed_while_idle(repeat: int) -> None:
    executor = make()
    try:
        pids = worker_pids(executor)
        called = threading.Event()
        failures: list[ExecutorFailedError] = []

        def on_failure(error: ExecutorFailedError) -> None:
            failures.append(error)
            called.set()

        executor.register_failure_callback(on_failure)
        killed_at = time.monotonic()
        os.kill(pids[0], signal.SIGKILL)
        assert called.wait(1.0), "the failure callback did not run within 1 s"
        assert time.monotonic() - killed_at < 1.0
        with pytest.raises(WorkerDiedError) as info:
            executor.collective_rpc("get_rank")
        assert info.value.rank == 0
        assert info.value.signal == signal.SIGKILL
        assert wait_gone(pids, 3.0) == []  # the idle survivor stops at SIGTERM
    finally:
        executor.shutdown()
    assert len(failures) == 1


@pytest.mark.usefixtures("shm_unchanged")
def test_shutdown_from_the_failure_callback() -> None:
    executor = make()
    pids = worker_pids(executor)
    closed = threading.Event()

    def on_failure(_error: ExecutorFailedError) -> None:
        executor.shutdown()  # runs in the monitor thread
        closed.set()

    executor.register_failure_callback(on_failure)
    os.kill(pids[1], signal.SIGKILL)
    assert closed.wait(5)
    assert executor.is_closed
    assert wait_gone(pids, 3.0) == []
    with pytest.raises(ExecutorError):
        executor.collective_rpc("get_rank")


def test_worker_exit_code_is_reported() -> None:
    executor = create_executor(
        conformance_config(
            "mp",
            world_size=2,
            worker_cls="mp_test_workers:CodecWorker",
            backend_options=FAST_STOP,
        )
    )
    try:
        future = executor.collective_rpc(
            lambda w: w.exit_now(3) if w.rank == 1 else w.slow(5.0), non_block=True
        )
        with pytest.raises(WorkerDiedError) as info:
            future.result(timeout=5)
        assert (info.value.rank, info.value.exitcode, info.value.signal) == (1, 3, None)
    finally:
        executor.shutdown()


def test_worker_exception_is_not_a_failure() -> None:
    executor = make()
    try:
        failures: list[ExecutorFailedError] = []
        executor.register_failure_callback(failures.append)
        with pytest.raises(WorkerError):
            executor.collective_rpc("fail", args=("boom",))
        assert executor.collective_rpc("get_rank") == [0, 1]
        assert not executor.is_failed
        assert failures == []
    finally:
        executor.shutdown()


def test_non_reply_rank_error_surfaces() -> None:
    executor = make()
    try:
        # Rank 0 fails at once; rank 1, the only one asked to answer, is still working.
        with pytest.raises(WorkerError) as info:
            executor.collective_rpc(
                lambda w: w.fail("only rank 0", on_rank=0) if w.rank == 0 else w.slow(0.3)[0],
                unique_reply_rank=1,
            )
        assert info.value.rank == 0
        assert executor.collective_rpc("get_rank", unique_reply_rank=1) == [1]
    finally:
        executor.shutdown()


# --- the driver dies ---------------------------------------------------------------------

DRIVER = textwrap.dedent(
    """
    import faulthandler, json, sys, time
    from executor_core import create_executor

    faulthandler.enable(all_threads=True)
    from executor_core.testing import conformance_config

    executor = create_executor(conformance_config("mp", world_size=2))
    print(json.dumps(executor.collective_rpc("get_pid")), flush=True)
    if sys.argv[1] == "busy":
        executor.collective_rpc("slow", args=(60.0,))
    else:
        time.sleep(60)
    """
)


def _start_driver(mode: str) -> tuple[subprocess.Popen[str], list[int]]:
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert driver.stdout is not None
    line = driver.stdout.readline()
    if not line:
        driver.wait(10)
        raise AssertionError(f"the driver did not start: {driver.stderr.read()}")  # type: ignore[union-attr]
    return driver, json.loads(line)


@pytest.mark.parametrize("repeat", range(REPEATS))
@pytest.mark.parametrize("mode", ["idle", "busy"])
@pytest.mark.usefixtures("shm_unchanged")
def test_driver_sigkill_stops_workers(mode: str, repeat: int) -> None:
    driver, pids = _start_driver(mode)
    try:
        time.sleep(0.2)
        killed_at = time.monotonic()
        driver.kill()
        driver.wait(10)
        assert wait_gone(pids, 2.0) == [], "workers outlived their driver by more than 2 s"
        assert time.monotonic() - killed_at < 2.5
    finally:
        driver.kill()
        driver.communicate(timeout=10)
        for pid in wait_gone(pids, 0):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.usefixtures("shm_unchanged")
def test_ctrl_c_in_driver_leaves_nothing() -> None:
    driver, pids = _start_driver("busy")
    time.sleep(0.3)
    driver.send_signal(signal.SIGINT)
    try:
        _out, err = driver.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        # Where it hangs: the driver's threads, dumped by faulthandler on SIGABRT.
        driver.send_signal(signal.SIGABRT)
        _out, err = driver.communicate(timeout=10)
        for pid in wait_gone(pids, 0):
            os.kill(pid, signal.SIGKILL)
        pytest.fail(f"the driver did not exit within 20 s of Ctrl-C:\n{err[-6000:]}")
    assert "KeyboardInterrupt" in err
    assert "resource_tracker" not in err
    assert "leaked" not in err
    assert wait_gone(pids, 2.0) == []


# --- start-up ----------------------------------------------------------------------------


@pytest.mark.parametrize("repeat", range(REPEATS))
@pytest.mark.usefixtures("shm_unchanged")
def test_startup_failure_names_rank_and_cleans_up(repeat: int) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(WorkerError) as info:
        make(worker_kwargs={"fail_init_on_rank": 1})
    assert info.value.rank == 1
    assert "init_device failed on purpose on rank 1" in str(info.value)
    assert "in init_device" in info.value.remote_traceback
    new = [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert wait_gone(new, 3.0) == []


def test_startup_import_error_has_traceback() -> None:
    with pytest.raises(WorkerError) as info:
        make(worker_cls="no_such_module_anywhere:Worker")
    assert "no_such_module_anywhere" in str(info.value)
    assert "ModuleNotFoundError" in info.value.exc_type


@pytest.mark.slow  # starts workers that each take a second to load
def test_workers_start_in_parallel() -> None:
    start = time.monotonic()
    executor = create_executor(
        conformance_config(
            "mp",
            world_size=2,
            worker_cls="mp_test_workers:SlowStartWorker",
            worker_kwargs={"init_s": 2.0},
        )
    )
    elapsed = time.monotonic() - start
    executor.shutdown()
    assert elapsed < 3.6, f"two 2 s start-ups took {elapsed:.2f} s: not in parallel"


# --- timeouts, threads, shutdown ---------------------------------------------------------


@pytest.mark.slow  # waits out timeouts, several times
@pytest.mark.parametrize("repeat", range(REPEATS))
def test_timeouts_then_success(repeat: int) -> None:
    executor = make()
    try:
        for i in range(3):
            with pytest.raises(RPCTimeoutError) as info:
                executor.collective_rpc("slow", args=(0.4, f"late-{i}"), timeout=0.05)
            assert set(info.value.ranks) == {0, 1}
            # The late replies are dropped: each call gets its own results.
            assert executor.collective_rpc("slow", args=(0.0, f"now-{i}")) == [
                (0, f"now-{i}"),
                (1, f"now-{i}"),
            ]
        future = executor.collective_rpc("slow", args=(0.4,), timeout=0.05, non_block=True)
        with pytest.raises(RPCTimeoutError):
            future.result(timeout=5)
        assert executor.collective_rpc("echo", args=("after",)) == [
            (0, ("after",), {}),
            (1, ("after",), {}),
        ]
    finally:
        executor.shutdown()


def test_eight_threads_at_once() -> None:
    executor = make()
    errors: list[BaseException] = []

    def client(index: int) -> None:
        try:
            for i in range(60):
                token = f"t{index}-{i}"
                if i % 3 == 0:
                    got = executor.collective_rpc("echo", args=(token,), non_block=True).result(30)
                elif i % 3 == 1:
                    got = executor.collective_rpc("echo", args=(token,), unique_reply_rank=1)
                    assert got == [(1, (token,), {})]
                    continue
                else:
                    got = executor.collective_rpc("echo", args=(token,))
                assert got == [(0, (token,), {}), (1, (token,), {})]
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    try:
        threads = [threading.Thread(target=client, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
    finally:
        executor.shutdown()


def test_blocking_call_from_a_future_callback() -> None:
    executor = make()
    try:
        seen: list[Any] = []
        done = threading.Event()

        def callback(_future: Future[list[Any]]) -> None:
            # Runs in the thread that reads replies; a blocking call here must not deadlock.
            seen.append(executor.collective_rpc("echo", args=("nested",), timeout=10))
            done.set()

        executor.collective_rpc("slow", args=(0.2,), non_block=True).add_done_callback(callback)
        assert done.wait(10)
        assert seen == [[(0, ("nested",), {}), (1, ("nested",), {})]]
        assert executor.collective_rpc("get_rank") == [0, 1]
    finally:
        executor.shutdown()


def test_many_calls_in_flight_beyond_the_ring() -> None:
    executor = make(backend_options={"slots": 2, "reply_slots": 1, **FAST_STOP})
    try:
        futures = [executor.collective_rpc("record", args=(i,), non_block=True) for i in range(50)]
        assert [f.result(timeout=30) for f in futures] == [[i + 1, i + 1] for i in range(50)]
    finally:
        executor.shutdown()


@pytest.mark.usefixtures("shm_unchanged")
def test_send_interrupted_mid_transfer_withdraws_the_call() -> None:
    executor = make(backend_options={"slots": 2, "slot_bytes": 64 << 10, **FAST_STOP})
    try:
        busy = executor.collective_rpc("slow", args=(1.0,), non_block=True)
        time.sleep(0.1)  # both workers are in the call: nobody reads the broadcast ring

        def interrupt() -> None:
            raise KeyboardInterrupt

        # 1 MiB is 16 slots of 64 KiB: two go out, then the send waits for room, and is
        # interrupted with part of the message published: the call is withdrawn.
        transport = executor.transport
        transport._while_sending = interrupt  # type: ignore[attr-defined]
        with pytest.raises(KeyboardInterrupt):
            executor.collective_rpc("record", args=(b"x" * (1 << 20),))
        del transport._while_sending  # type: ignore[attr-defined]  # the method again
        assert not executor.is_failed
        assert busy.result(timeout=5) == [(0, None), (1, None)]
        # No rank ran the withdrawn call: this is the first record on each.
        assert executor.collective_rpc("record", args=("after",), timeout=10) == [1, 1]
    finally:
        executor.shutdown()


@pytest.mark.usefixtures("shm_unchanged")
def test_a_call_larger_than_the_ring_returns_by_its_deadline_with_both_ranks_busy() -> None:
    """With both ranks in a long call nobody reads the broadcast ring: a call longer than the
    whole ring cannot be finished, and it must still return by its timeout (it used to wait
    for ever, then to fail the executor): withdrawn, and the executor goes on."""
    executor = make(backend_options={"slots": 2, "slot_bytes": 64 << 10, **FAST_STOP})
    try:
        busy = executor.collective_rpc("slow", args=(2.0,), non_block=True)
        time.sleep(0.1)  # both workers are in the call
        start = time.monotonic()
        with pytest.raises(RPCTimeoutError) as info:
            executor.collective_rpc("record", args=(b"x" * (1 << 20),), timeout=0.5)
        assert time.monotonic() - start < 1.5
        assert set(info.value.ranks) == {0, 1}
        assert not executor.is_failed
        assert busy.result(timeout=5) == [(0, None), (1, None)]
        assert executor.collective_rpc("record", args=("after",), timeout=10) == [1, 1]
    finally:
        start = time.monotonic()
        executor.shutdown()
        assert time.monotonic() - start < 10.0


@pytest.mark.usefixtures("shm_unchanged")
@pytest.mark.parametrize("recovery", [False, True], ids=["no-policy", "policy"])
@pytest.mark.parametrize("slots", ["small", "default"])
def test_a_64mib_call_past_its_deadline_with_a_rank_busy_is_withdrawn(
    tmp_path: Any, slots: str, recovery: bool
) -> None:
    """Issue 51: a 64 MiB call whose deadline passes part-way through its transfer (rank 1
    is busy, so the ring fills) raises RPCTimeoutError naming the ranks; no rank runs it,
    and once rank 1 is free the executor answers the next call, with no failure and no
    recovery. ``default``: the default ring (4 slots of 16 MiB, 4 MiB chunks)."""
    options = {"slots": 2, "slot_bytes": 64 << 10} if slots == "small" else {}
    policy = RecoveryPolicy(backoff_s=0.0) if recovery else None
    executor = make(backend_options={**options, **FAST_STOP}, recovery=policy)
    release = tmp_path / "release"
    try:
        busy = executor.collective_rpc("hold", args=(str(release), 1, 30.0), non_block=True)
        time.sleep(0.1)  # rank 0 answered, rank 1 holds
        start = time.monotonic()
        with pytest.raises(RPCTimeoutError) as info:
            executor.collective_rpc("record", args=(b"x" * (64 << 20),), timeout=2)
        assert time.monotonic() - start < 4.0
        assert set(info.value.ranks) == {0, 1}
        # Another large call while rank 1 still holds: withdrawn before any of it went out.
        future = executor.collective_rpc(
            "record", args=(b"y" * (64 << 20),), timeout=0.5, non_block=True
        )
        with pytest.raises(RPCTimeoutError):
            future.result(timeout=5)
        release.touch()
        assert busy.result(timeout=10) == [0, 1]
        assert executor.collective_rpc("get_rank", timeout=10) == [0, 1]
        # No rank ran either withdrawn call: this is the first record on each.
        assert executor.collective_rpc("record", args=("after",), timeout=10) == [1, 1]
        assert executor.state is ExecutorState.RUNNING
        assert executor.last_recovery is None
    finally:
        executor.shutdown()


@pytest.mark.usefixtures("shm_unchanged")
def test_shutdown_during_a_call_fails_it_and_stops_workers() -> None:
    executor = make()
    pids = worker_pids(executor)
    future: Future[list[Any]] = executor.collective_rpc("slow", args=(30.0,), non_block=True)
    time.sleep(0.1)
    start = time.monotonic()
    executor.shutdown()
    assert time.monotonic() - start < 5.0
    with pytest.raises(ExecutorClosedError):
        future.result(timeout=1)
    assert wait_gone(pids, 1.0) == []
    executor.shutdown()  # idempotent


@pytest.mark.usefixtures("shm_unchanged")
def test_dropping_the_executor_stops_its_workers() -> None:
    import gc

    executor = make()
    pids = worker_pids(executor)
    del executor
    gc.collect()
    assert wait_gone(pids, 5.0) == []


def test_bad_backend_options_are_rejected() -> None:
    with pytest.raises(ExecutorError, match="unknown key"):
        make(backend_options={"slotz": 3})
    with pytest.raises(ExecutorError, match="'slots' must be an integer >= 2"):
        make(backend_options={"slots": 1})
    with pytest.raises(ExecutorError, match="start_method"):
        make(backend_options={"start_method": "thread"})


def test_dev_shm_too_small_is_a_clear_error() -> None:
    stats = os.statvfs("/dev/shm")
    free = stats.f_bavail * stats.f_frsize
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ExecutorError, match=r"/dev/shm has \d+ MiB free.*--shm-size"):
        make(backend_options={"slot_bytes": free // 2 + 4096})
    assert {p.pid for p in psutil.Process().children(recursive=True)} - before == set()
