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
from unittest import mock

import pytest

from executor_core import (
    ExecutorClosedError,
    ExecutorError,
    ExecutorFailedError,
    ExecutorState,
    WorkerContext,
    WorkerDiedError,
    hookimpl,
)
from executor_core.backend import Registry

from ._base import ExecutorFactory, KitBase
from ._guard import (
    Footprint,
    ended,
    pids_alive,
    private_tempdir,
    process_identity,
    temp_leftovers,
    wait_until,
)


class _HookObserver:
    """Records the worker-side hooks it sees (for workers in the driver's process)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    @hookimpl
    def executor_worker_ready(self, context: WorkerContext) -> None:
        self.events.append(("ready", context.rank))

    @hookimpl
    def executor_worker_rpc_finished(self, context: WorkerContext) -> None:
        self.events.append(("rpc", context.rank))

    @hookimpl
    def executor_worker_stopping(self, context: WorkerContext) -> None:
        self.events.append(("stopping", context.rank))


def _collective_with(worker: Any, victim: int, victim_pid: int) -> int:
    """A collective whose peer dies: ``victim`` is busy; rank 0 fails as soon as the victim's
    process has ended (gloo's "Connection reset"), likely before the driver sees it."""
    if worker.rank == victim:
        time.sleep(60)
    elif worker.rank == 0:
        wait_until(lambda: ended(victim_pid), 60, 0.0005)
        raise ConnectionResetError(f"Connection reset by peer (rank {victim} is gone)")
    return int(worker.rank)


class LifecycleTests(KitBase):
    """Failure, shutdown and the finalizer leave nothing behind."""

    #: Collective deaths in ``test_a_death_is_reported_once_as_a_death``: races show in some.
    kill_checks: ClassVar[int] = 3

    def _check_nothing_left(self, before: Footprint, pids: list[int | None], when: str) -> None:
        """No worker process runs, and within ``settle_s`` the driver has no new thread,
        descriptor or /dev/shm mapping, nor is a /dev/shm name it or a worker held left (the
        shared executor came first: what a process's first one starts for good, such as a
        multiprocessing resource tracker, is not this executor's)."""
        alive = pids_alive([p for p in pids if p], self.settle_s)
        assert not alive, f"rule broken: worker processes {alive} still run {when}"
        left = before.leftovers(self.settle_s)
        assert not left, f"rule broken: left behind {when}: {left}"

    def test_failure_callbacks_run_once(
        self, fresh_executor: ExecutorFactory, tmp_path: Path
    ) -> None:
        """Rule: ``fail()`` fails calls in flight at once and runs each callback once."""
        executor = fresh_executor()
        calls: list[ExecutorFailedError] = []
        executor.register_failure_callback(calls.append)
        future, start = self.hold_last_rank(executor, tmp_path / "go"), time.monotonic()
        error = ExecutorFailedError("simulated failure")
        assert executor.fail(error) is True
        with pytest.raises(ExecutorFailedError, match="simulated failure"):
            future.result(timeout=self.slow_call_s * 6)
        (tmp_path / "go").touch()
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
        for call in (executor.check_health, lambda: executor.execute_model(None)):
            with pytest.raises(ExecutorClosedError):
                call()
        with pytest.raises(ExecutorClosedError):
            executor.collective_rpc("get_rank", timeout=10)

    def test_env_reaches_workers_not_the_driver(self, fresh_executor: ExecutorFactory) -> None:
        """Rule: ``config.env`` and the driver's ``NCCL_*`` reach every worker, not the driver."""
        name = f"EXECUTOR_CONFORMANCE_{uuid.uuid4().hex[:8].upper()}"
        forwarded, overridden = f"NCCL_{name}", f"TORCH_NCCL_{name}"
        driver_env = {forwarded: "set-in-driver", overridden: "set-in-driver"}
        with mock.patch.dict(os.environ, driver_env):  # and put back after
            env = {name: "set-by-config", overridden: "set-by-config"}
            executor = fresh_executor(env=env, worker_kwargs={"tag": "kw"})
            assert executor.collective_rpc("get_tag") == ["kw"] * executor.world_size
            for var, rule in (
                (name, "config.env is set in every worker"),
                (forwarded, "the driver's NCCL_* variables reach every worker"),
                (overridden, "config.env wins over a forwarded driver variable"),
            ):
                got = executor.collective_rpc("get_env", args=(var,))
                want = env.get(var, "set-in-driver")
                assert got == [want] * executor.world_size, f"rule broken: {rule}: {got}"
            executor.shutdown()
            assert (os.environ.get(name), os.environ.get(overridden)) == (None, "set-in-driver"), (
                "rule broken: config.env does not leak into the driver's environment"
            )

    def test_worker_init_failure_fails_creation(self, executor_factory: ExecutorFactory) -> None:
        with pytest.raises(ExecutorError) as info:
            executor_factory(worker_kwargs={"fail_init_on_rank": 0}).shutdown()
        assert "init_device failed on purpose" in str(info.value)
        assert "rank 0" in str(info.value)

    @pytest.mark.usefixtures("executor")  # see _check_nothing_left
    def test_shutdown_stops_every_worker(
        self, executor_factory: ExecutorFactory, tmp_path: Path
    ) -> None:
        """Rule: ``shutdown()`` runs every worker's shutdown through its wrapper (so the hooks
        run; the registry's reach ranks in the driver's process), and leaves nothing the
        executor made (see :meth:`_check_nothing_left`) nor anything in its temporary
        directory (the kit's own while it lives; but ``session_temp_files``)."""
        registry = Registry.from_entry_points()
        observer = _HookObserver()
        registry.register_plugin(observer, "conformance-hook-observer")
        before = Footprint(self.session_threads, self.check_fds)
        with private_tempdir() as tmp:
            marker_dir = {"marker_dir": str(tmp_path)}
            executor = executor_factory(registry=registry, worker_kwargs=marker_dir)
            try:
                pids = self.worker_processes(executor)
                executor.collective_rpc("get_rank", non_block=True).result(timeout=30)
                before.note(pids)
                me = (os.getpid(), process_identity())
                processes = executor.collective_rpc("get_process", timeout=30)
                in_driver = [rank for rank, p in enumerate(processes) if tuple(p) == me]
            finally:
                executor.shutdown()
            temp_left = temp_leftovers(tmp, self.settle_s, self.session_temp_files)
        for rank in range(executor.world_size):
            marker = tmp_path / f"shutdown-{rank}"
            assert marker.exists(), f"rule broken: shutdown() runs every worker's shutdown ({rank})"
            assert marker.read_text() == "wrapper", (
                f"rule broken: rank {rank}'s executor_worker_stopping hook did not run (call "
                "WorkerWrapper.shutdown)"
            )
        for rank in in_driver:
            for event in ("ready", "rpc", "stopping"):
                assert (event, rank) in observer.events, (
                    f"rule broken: the registry's worker hooks reach rank {rank} (in the "
                    f"driver's process): no {event!r}"
                )
        self._check_nothing_left(before, pids, "after shutdown()")
        assert not temp_left, (
            f"rule broken: temporary files and directories the backend creates are gone after "
            f"shutdown(), not {temp_left}"
        )

    @pytest.mark.usefixtures("executor")  # see _check_nothing_left
    def test_dropped_executor_is_collected_and_cleaned_up(
        self, executor_factory: ExecutorFactory
    ) -> None:
        before = Footprint(self.session_threads, self.check_fds)
        executor = executor_factory()
        pids = self.worker_processes(executor)
        executor.collective_rpc("get_rank", non_block=True).result(timeout=30)
        before.note(pids)
        ref = weakref.ref(executor)
        del executor
        gc.collect()
        assert ref() is None, (
            "rule broken: an executor dropped without shutdown() is garbage-collected (no "
            "transport, thread or callback holds it)"
        )
        self._check_nothing_left(before, pids, "after the executor was dropped")

    def test_a_death_is_reported_once_as_a_death(self, fresh_executor: ExecutorFactory) -> None:
        """Rule: a worker process killed in a call fails it with ``WorkerDiedError`` naming the
        rank, never a survivor's error (a plain call, then ``kill_checks`` calls whose reply
        rank fails as its peer goes, as a collective does); by then the state is failed and
        the callbacks ran once; a ``shutdown()`` at once is prompt, no worker left."""
        for attempt in range(self.kill_checks + 1):
            executor = fresh_executor()
            failures: list[ExecutorFailedError] = []
            executor.register_failure_callback(failures.append)
            pids = self.worker_processes(executor)
            if attempt == 0:
                victim, pid = self.victim(pids)
                future = executor.collective_rpc("slow", args=(self.time_limit_s,), non_block=True)
            else:
                victim, pid = self.victim(pids, avoid=[pids[0]])
                future = executor.collective_rpc(
                    _collective_with, args=(victim, pid), non_block=True, unique_reply_rank=0
                )
            time.sleep(0.2)  # the call reached the workers
            os.kill(pid, signal.SIGKILL)
            where = f"(kill {attempt + 1} of {self.kill_checks + 1})"
            self.died(future, victim, f"a worker's death fails the call in flight {where}")
            state, reported = executor.state, list(failures)
            with pytest.raises(ExecutorFailedError):
                executor.collective_rpc("get_rank", timeout=10)
            self.assert_prompt_shutdown(executor, "at once after a worker's death")
            told = [type(f) for f in reported]
            assert (state, told) == (ExecutorState.FAILED, [WorkerDiedError]), (
                f"rule broken: by the time the caller sees a death, the state is failed and "
                f"the failure callbacks ran once: {state}, {reported} {where}"
            )
            assert failures == reported, f"rule broken: callbacks ran again: {failures} {where}"
            alive = pids_alive([p for p in pids if p], self.settle_s)
            assert not alive, f"rule broken: worker processes {alive} still run {where}"

    def test_shutdown_with_calls_in_flight(
        self, fresh_executor: ExecutorFactory, tmp_path: Path
    ) -> None:
        """Rule: ``shutdown()`` with a rank hung in a call returns within ``shutdown_s`` (the
        rank is stopped by force after a grace, not waited for); calls in flight complete or
        fail with ``ExecutorClosedError``, the hung one fails."""
        executor, release = fresh_executor(), tmp_path / "release"
        done = executor.collective_rpc("slow", args=(0.3,), non_block=True)
        hung = self.hold_last_rank(executor, release)
        self.assert_prompt_shutdown(executor, "with a rank hung in a call", release)
        with contextlib.suppress(ExecutorClosedError):
            result = done.result(timeout=self.settle_s)
            assert result == [(r, None) for r in range(executor.world_size)], result
        error = hung.exception(timeout=self.settle_s)
        assert isinstance(error, ExecutorClosedError), (
            f"rule broken: shutdown() fails the call a hung rank holds with ExecutorClosedError, "
            f"not {error!r}"
        )
