"""Lifecycle: failure, shutdown (with calls in flight and a rank hung), the finalizer, env,
hooks, a worker's death, and what the executor leaves behind."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import time
import uuid
import weakref
from pathlib import Path
from typing import Any, ClassVar

import pytest

from executor_core import (
    ExecutorClosedError,
    ExecutorError,
    ExecutorFailedError,
    ExecutorState,
    WorkerBase,
    WorkerContext,
    WorkerDiedError,
    hookimpl,
)
from executor_core.backend import Registry

from ._base import ExecutorFactory, KitBase
from ._guard import (
    Footprint,
    pids_alive,
    private_tempdir,
    process_identity,
    running,
    temp_leftovers,
    wait_until,
)

__all__ = ["LifecycleTests"]


class _HookObserver:
    """Records the worker-side hooks it sees (for workers in the driver's process)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    @hookimpl
    def executor_worker_ready(self, worker: WorkerBase, context: WorkerContext) -> None:
        self.events.append(("ready", context.rank))

    @hookimpl
    def executor_worker_rpc_finished(
        self, context: WorkerContext, method: str, duration_s: float, error: BaseException | None
    ) -> None:
        self.events.append(("rpc", context.rank))

    @hookimpl
    def executor_worker_stopping(self, worker: WorkerBase | None, context: WorkerContext) -> None:
        self.events.append(("stopping", context.rank))


def _collective_with(worker: Any, victim: int, victim_pid: int) -> int:
    """What a collective does when a peer dies: rank ``victim`` is busy (the test kills it);
    rank 0 fails the moment the victim's process has ended (gloo's "Connection reset by
    peer"), likely before the driver has seen the death; any other rank returns."""
    if worker.rank == victim:
        time.sleep(60)
    elif worker.rank == 0:
        wait_until(lambda: not running(victim_pid), 60, 0.0005)
        raise ConnectionResetError(f"Connection reset by peer (rank {victim} is gone)")
    rank: int = worker.rank
    return rank


class LifecycleTests(KitBase):
    """Failure, shutdown and the finalizer leave nothing behind."""

    #: Times :meth:`test_a_death_is_reported_once_as_a_death` kills a worker (a fresh
    #: executor each time): its races show in some runs, not in one.
    kill_checks: ClassVar[int] = 3

    def _check_nothing_left(self, before: Footprint, pids: list[int | None], when: str) -> None:
        alive = pids_alive([p for p in pids if p], self.settle_s)
        assert not alive, f"rule broken: worker processes {alive} still run {when}"
        left = before.wait_clean(self.settle_s, self.session_threads, self.check_fds)
        assert not left, f"rule broken: left behind {when}: {left}"

    def test_failure_callbacks_run_once(self, fresh_executor: ExecutorFactory) -> None:
        """Rule: ``fail()`` fails the calls in flight at once and runs the failure callbacks
        once (a callback registered later runs at once); calls then raise."""
        executor = fresh_executor()
        calls: list[ExecutorFailedError] = []
        executor.register_failure_callback(calls.append)
        future = executor.collective_rpc("slow", args=(self.slow_call_s * 3,), non_block=True)
        start = time.monotonic()
        error = ExecutorFailedError("simulated failure")
        assert executor.fail(error) is True
        with pytest.raises(ExecutorFailedError, match="simulated failure"):
            future.result(timeout=self.slow_call_s * 6)
        assert time.monotonic() - start < self.slow_call_s, (
            "rule broken: fail() fails the calls in flight at once"
        )
        assert executor.fail(ExecutorFailedError("second")) is False
        assert calls == [error], "rule broken: failure callbacks run exactly once"
        late: list[ExecutorFailedError] = []
        executor.register_failure_callback(late.append)
        assert late == [error], "rule broken: a callback registered after a failure runs at once"
        with pytest.raises(ExecutorFailedError, match="simulated failure"):
            executor.collective_rpc("get_rank", timeout=10)
        with pytest.raises(ExecutorFailedError):
            executor.check_health()

    def test_shutdown_is_idempotent_and_final(self, fresh_executor: ExecutorFactory) -> None:
        with fresh_executor() as executor:
            assert executor.collective_rpc("get_rank") == list(range(executor.world_size))
        assert executor.is_closed, "rule broken: leaving a with block shuts the executor down"
        executor.shutdown()
        executor.shutdown()
        assert executor.is_closed
        with pytest.raises(ExecutorClosedError):
            executor.collective_rpc("get_rank", timeout=10)
        with pytest.raises(ExecutorClosedError):
            executor.execute_model(None)
        with pytest.raises(ExecutorClosedError):
            executor.check_health()

    def test_shutdown_with_calls_in_flight(
        self, fresh_executor: ExecutorFactory, tmp_path: Path
    ) -> None:
        """Rule: ``shutdown()`` with calls in flight and a rank hung in one of them, past
        ``shutdown_s``, returns within ``shutdown_s`` (after the backend's grace, the hung
        rank is stopped by force, not waited for); a call that ran on every rank completes
        or fails with :class:`ExecutorClosedError`, the hung one fails with it."""
        executor = fresh_executor()
        release = tmp_path / "release"
        done = executor.collective_rpc("slow", args=(0.3,), non_block=True)
        hold = (str(release), executor.world_size - 1, self.time_limit_s)
        hung = executor.collective_rpc("hold", args=hold, non_block=True)
        self.assert_prompt_shutdown(executor, "with a rank hung in a call", release)
        with contextlib.suppress(ExecutorClosedError):
            result = done.result(timeout=self.settle_s)
            assert result == [(r, None) for r in range(executor.world_size)], result
        error = hung.exception(timeout=self.settle_s)
        assert isinstance(error, ExecutorClosedError), (
            f"rule broken: shutdown() fails the call a hung rank holds with ExecutorClosedError, "
            f"not {error!r}"
        )

    def test_env_reaches_workers_not_the_driver(self, fresh_executor: ExecutorFactory) -> None:
        """Rule: ``config.env`` and the driver's ``NCCL_*`` variables reach every worker (a
        cluster's workers do not inherit the driver's environment), ``config.env`` winning;
        the driver's environment is as it was after shutdown; ``worker_kwargs`` reach the
        worker."""
        name = f"EXECUTOR_CONFORMANCE_{uuid.uuid4().hex[:8].upper()}"
        forwarded, overridden = f"NCCL_{name}", f"TORCH_NCCL_{name}"
        os.environ[forwarded] = os.environ[overridden] = "set-in-driver"
        try:
            executor = fresh_executor(
                env={name: "set-by-config", overridden: "set-by-config"},
                worker_kwargs={"tag": "kw"},
            )
            ws = executor.world_size
            assert executor.collective_rpc("get_tag") == ["kw"] * ws
            assert executor.collective_rpc("get_env", args=(name,)) == ["set-by-config"] * ws, (
                "rule broken: config.env is set in every worker"
            )
            assert (
                executor.collective_rpc("get_env", args=(forwarded,)) == ["set-in-driver"] * ws
            ), "rule broken: the driver's NCCL_* variables reach every worker"
            assert (
                executor.collective_rpc("get_env", args=(overridden,)) == ["set-by-config"] * ws
            ), "rule broken: config.env wins over a forwarded driver variable"
            executor.shutdown()
            assert name not in os.environ, (
                "rule broken: config.env leaked into the driver's environment after shutdown"
            )
            assert os.environ.get(overridden) == "set-in-driver", (
                "rule broken: the driver's own value of a variable config.env sets is back "
                "after shutdown"
            )
        finally:
            os.environ.pop(forwarded, None)
            os.environ.pop(overridden, None)

    def test_worker_init_failure_fails_creation(self, executor_factory: ExecutorFactory) -> None:
        with pytest.raises(ExecutorError) as info:
            executor_factory(worker_kwargs={"fail_init_on_rank": 0}).shutdown()
        assert "init_device failed on purpose" in str(info.value)
        assert "rank 0" in str(info.value)

    def test_shutdown_stops_every_worker(
        self, executor_factory: ExecutorFactory, tmp_path: Path
    ) -> None:
        """Rule: ``shutdown()`` runs every worker's shutdown through its wrapper (so the
        ``executor_worker_stopping`` hook runs, and the registry's worker hooks reach ranks in
        the driver's process) and leaves nothing the executor made: no worker process, and,
        within ``settle_s``, no new thread or descriptor in the driver, no /dev/shm mapping
        it made, no /dev/shm name the driver or a worker process held, nothing in
        ``tempfile.gettempdir()`` (an empty directory of the kit's while the executor
        lives, ``TMPDIR`` for the processes it starts; but ``session_temp_files``)."""
        registry = Registry.from_entry_points()
        observer = _HookObserver()
        registry.register_plugin(observer, "conformance-hook-observer")
        before = Footprint.take()
        with private_tempdir() as tmp:
            marker_dir = {"marker_dir": str(tmp_path)}
            executor = executor_factory(registry=registry, worker_kwargs=marker_dir)
            try:
                pids = self.worker_processes(executor)
                executor.collective_rpc("get_rank", non_block=True).result(timeout=30)
                before.note(p for p in pids if p)
                me = (os.getpid(), process_identity())
                processes = executor.collective_rpc("get_process", timeout=30)
                in_driver = [rank for rank, p in enumerate(processes) if tuple(p) == me]
            finally:
                executor.shutdown()
            temp_left = temp_leftovers(tmp, self.settle_s, self.session_temp_files)
        for rank in range(executor.world_size):
            marker = tmp_path / f"shutdown-{rank}"
            assert marker.exists(), (
                f"rule broken: shutdown() runs every worker's shutdown; rank {rank}'s did not "
                "run (call WorkerWrapper.shutdown when the transport closes)"
            )
            assert marker.read_text() == "wrapper", (
                f"rule broken: rank {rank}'s worker was shut down without its wrapper, so the "
                "executor_worker_stopping hook did not run (call WorkerWrapper.shutdown)"
            )
        for rank in in_driver:
            for event in ("ready", "rpc", "stopping"):
                assert (event, rank) in observer.events, (
                    f"rule broken: the registry's worker hooks reach rank {rank}, which runs "
                    f"in the driver's process, but {event!r} was not seen"
                )
        self._check_nothing_left(before, pids, "after shutdown()")
        assert not temp_left, (
            f"rule broken: temporary files and directories the backend creates are gone after "
            f"shutdown(); left in tempfile.gettempdir(): {temp_left} (remove them in close() "
            "or with host.add_cleanup)"
        )

    def test_dropped_executor_is_collected_and_cleaned_up(
        self, executor_factory: ExecutorFactory
    ) -> None:
        before = Footprint.take()
        executor = executor_factory()
        pids = self.worker_processes(executor)
        executor.collective_rpc("get_rank", non_block=True).result(timeout=30)
        before.note(p for p in pids if p)
        ref = weakref.ref(executor)
        del executor
        gc.collect()
        assert ref() is None, (
            "rule broken: an executor dropped without shutdown() is garbage-collected; "
            "something still holds it (a transport, a thread or a callback must never hold "
            "the executor)"
        )
        self._check_nothing_left(before, pids, "after the executor was dropped")

    def test_killed_worker_fails_the_call_in_flight(self, fresh_executor: ExecutorFactory) -> None:
        """Rule: a worker process that dies (SIGKILL, by the pid it reports; where a rank runs
        in a worker process of its own on this machine) fails the call in flight with
        :class:`WorkerDiedError` naming its rank, within ``settle_s``; the failure callbacks
        run once; later calls raise; ``shutdown()`` returns promptly, no worker left."""
        executor = fresh_executor()
        failures: list[ExecutorFailedError] = []
        executor.register_failure_callback(failures.append)
        pids = self.worker_processes(executor)
        victim, pid = self.victim(pids)
        future = executor.collective_rpc("slow", args=(self.time_limit_s,), non_block=True)
        time.sleep(min(0.2, self.slow_call_s / 5))  # the call reached the workers
        os.kill(pid, signal.SIGKILL)
        try:
            error = future.exception(timeout=self.settle_s)
        except TimeoutError:
            pytest.fail(
                f"rule broken: a worker's death fails the call in flight; rank {victim}'s "
                f"process was killed and the call still waits after {self.settle_s:g} s "
                "(watch the workers and call host.worker_died)"
            )
        assert isinstance(error, WorkerDiedError), (
            f"rule broken: a worker's death fails the call in flight with WorkerDiedError, "
            f"not {error!r}"
        )
        assert error.rank == victim or victim in error.ranks, (
            f"rule broken: the WorkerDiedError names the rank that died ({victim}), not "
            f"{error.rank}"
        )
        wait_until(lambda: failures, self.settle_s)
        time.sleep(0.2)  # a second report would land now
        assert len(failures) == 1, (
            f"rule broken: after a worker's death the failure callbacks run once, not "
            f"{len(failures)} times"
        )
        assert isinstance(failures[0], WorkerDiedError)
        with pytest.raises(ExecutorFailedError):
            executor.collective_rpc("get_rank", timeout=10)
        self.assert_prompt_shutdown(executor, "after a worker's death")
        alive = pids_alive([p for p in pids if p], self.settle_s)
        assert not alive, f"rule broken: worker processes {alive} still run after shutdown()"

    def test_a_death_is_reported_once_as_a_death(self, fresh_executor: ExecutorFactory) -> None:
        """Rule: a worker killed during a ``unique_reply_rank`` call, whose reply rank fails
        the moment its peer is gone (as a collective does), fails the call with
        :class:`WorkerDiedError` naming it, never the survivor's error; by the time the
        caller sees it, the failure callbacks have run once and the state is ``failed``, so
        a ``shutdown()`` at once loses nothing and leaves nothing behind. ``kill_checks``
        times, each on a fresh executor (where a rank other than the reply rank runs in a
        worker process of its own)."""
        for attempt in range(self.kill_checks):
            executor = fresh_executor()
            failures: list[ExecutorFailedError] = []
            executor.register_failure_callback(failures.append)
            pids = self.worker_processes(executor)
            victim, pid = self.victim(pids, avoid=[pids[0]])
            future = executor.collective_rpc(
                _collective_with, args=(victim, pid), non_block=True, unique_reply_rank=0
            )
            time.sleep(0.2)  # the call reached the workers
            os.kill(pid, signal.SIGKILL)
            try:
                error = future.exception(timeout=self.settle_s)
            except TimeoutError:
                pytest.fail(f"rule broken: the call still waits {self.settle_s:g} s after a death")
            state, reported = executor.state, list(failures)
            self.assert_prompt_shutdown(executor, "at once after a worker's death")
            where = f"(kill {attempt + 1} of {self.kill_checks})"
            assert isinstance(error, WorkerDiedError), f"rule broken: not a death: {error!r}"
            assert victim in error.ranks, (
                f"rule broken: a call in flight on a dying rank raises WorkerDiedError naming "
                f"rank {victim}, even when a survivor's error comes first, not {error!r} {where}"
            )
            assert [type(f) for f in reported] == [WorkerDiedError], (
                f"rule broken: the failure callbacks have run once when the caller sees the "
                f"death: {reported} {where}"
            )
            assert state is ExecutorState.FAILED, (
                f"rule broken: the state is failed when the caller sees the death, not {state} "
                f"{where}"
            )
            assert failures == reported, f"rule broken: callbacks ran again: {failures} {where}"
            alive = pids_alive([p for p in pids if p], self.settle_s)
            assert not alive, f"rule broken: worker processes {alive} still run {where}"
