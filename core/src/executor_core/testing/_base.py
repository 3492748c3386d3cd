"""What every area of the kit shares: the backend under test, its configs, the fixtures that
build executors, the time guard around each test, and the worker processes it may kill."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import pytest

from executor_core import (
    Executor,
    ExecutorConfig,
    ExecutorState,
    RPCTimeoutError,
    WorkerDiedError,
    create_executor,
)
from executor_core.backend import BackendSpec, Registry, default_registry

from ._guard import process_identity, time_limit, wait_until
from ._workers import ConformanceWorker

#: Builds a started executor: ``make(registry=None, **config_overrides)``.
ExecutorFactory = Callable[..., Executor]


def conformance_config(backend: str | type, **overrides: Any) -> ExecutorConfig:
    """An ExecutorConfig that runs :class:`ConformanceWorker` on ``backend``; ``world_size``
    stands for ``tensor_parallel_size`` times ``pipeline_parallel_size``."""
    world_size = overrides.pop("world_size", None)
    if world_size is not None and "tensor_parallel_size" not in overrides:
        overrides["tensor_parallel_size"] = world_size // overrides.get("pipeline_parallel_size", 1)
    overrides.setdefault("worker_cls", ConformanceWorker)
    return ExecutorConfig(backend=backend, **overrides)


def check_reply_ranks(executor: Executor, timeout: float, step_s: float = 0.0) -> None:
    """Fail unless every rank's reply comes labelled with its rank within ``timeout``; with
    ``step_s`` the highest rank answers first (labels by order of arrival show)."""
    method, args = ("rank_in_reverse", (step_s,)) if step_s else ("get_rank", ())
    try:
        ranks = executor.collective_rpc(method, args=args, timeout=timeout)
    except RPCTimeoutError as exc:
        raise AssertionError(
            f"rule broken: replies carry the rank they came from; ranks {list(exc.ranks)} "
            f"never answered as themselves within {timeout:g} s"
        ) from exc
    assert ranks == list(range(executor.world_size)), (
        f"rule broken: replies carry the rank they came from, one per rank in rank order, "
        f"whatever order they arrive in: got {ranks}"
    )


def in_threads(count: int, target: Callable[[int], object]) -> None:
    """Run ``target(i)`` on ``count`` threads at once; fail if one raises or takes 2 minutes."""
    pool = ThreadPoolExecutor(count)
    try:
        for future in [pool.submit(target, i) for i in range(count)]:
            future.result(timeout=120)
    finally:
        pool.shutdown(wait=False)


class KitBase:
    """Declare the backend under test in a subclass; override :meth:`executor_factory` only if
    the executor needs more than a config (a cluster fixture, say)."""

    #: The backend under test: its registered name (or alias), or an Executor subclass.
    backend: ClassVar[str | type] = ""
    #: Workers per executor (``uni`` runs 1).
    world_size: ClassVar[int] = 2
    #: Pipeline stages of the shared executor (world_size must be a multiple).
    pipeline_parallel_size: ClassVar[int] = 1
    #: Nodes of every executor whose world size is a multiple of it (the others run on one).
    num_nodes: ClassVar[int] = 1
    #: ``backend_options`` of every executor the kit builds.
    backend_options: ClassVar[dict[str, Any]] = {}
    #: Seconds one test may take, start-up and shutdown included: past it the test fails.
    time_limit_s: ClassVar[float] = 60.0
    #: Seconds workers, threads and descriptors get to go after shutdown or a drop.
    settle_s: ClassVar[float] = 10.0
    #: Seconds a slow call sleeps in the timeout tests; the timeout is a fraction of it.
    slow_call_s: ClassVar[float] = 1.0
    #: Name prefixes of threads the backend keeps for its session across executors.
    session_threads: ClassVar[tuple[str, ...]] = ()
    #: False if the backend's session keeps descriptors across executors (a cluster client).
    check_fds: ClassVar[bool] = True
    #: Seconds ``shutdown()`` may take with a rank hung (its grace before force).
    shutdown_s: ClassVar[float] = 30.0
    #: Bytes of a call that no queue or ring of the backend holds whole (``mp``'s: 64 MiB).
    large_call_bytes: ClassVar[int] = 80 << 20
    #: Name prefixes of ``tempfile.gettempdir()`` entries the backend's session keeps.
    session_temp_files: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def make_config(cls, **overrides: Any) -> ExecutorConfig:
        """The config of an executor under test, with ``overrides`` applied."""
        if not cls.backend:
            raise TypeError(
                f"{cls.__name__} must set backend = '<your backend name>' (or override "
                "the executor_factory fixture)"
            )
        overrides.setdefault("pipeline_parallel_size", cls.pipeline_parallel_size)
        overrides.setdefault("world_size", cls.world_size)
        if "num_nodes" not in overrides and overrides["world_size"] % cls.num_nodes == 0:
            overrides["num_nodes"] = cls.num_nodes
        options = {**cls.backend_options, **overrides.pop("backend_options", {})}
        return conformance_config(cls.backend, backend_options=options, **overrides)

    @classmethod
    def reply_probe_s(cls) -> float:
        """Seconds the kit gives a trivial call (``get_rank``) on a new executor."""
        return min(30.0, cls.time_limit_s / 4)

    @classmethod
    def spec(cls) -> BackendSpec | None:
        """The backend's declaration in the registry (None for an unregistered class)."""
        backend = cls.backend
        if isinstance(backend, str) and backend and ":" not in backend:
            return default_registry().get(backend)
        return None

    def worker_processes(self, executor: Executor) -> list[int | None]:
        """Each rank's pid where it runs in a process of its own on this machine (the same
        ``process_identity`` seen from here), else None: the ones the kit may kill."""
        found = executor.collective_rpc("get_process", timeout=self.reply_probe_s())
        mine = os.getpid()
        return [p if p != mine and who and who == process_identity(p) else None for p, who in found]

    def victim(self, pids: list[int | None], avoid: Iterable[int | None] = ()) -> tuple[int, int]:
        """``(rank, pid)`` of the highest rank of ``pids`` with a process (not in ``avoid``);
        the test is skipped where there is none."""
        avoid = set(avoid)
        found = [(r, pid) for r, pid in enumerate(pids) if pid is not None and pid not in avoid]
        if not found:
            pytest.skip("no rank runs in a worker process of its own on this machine")
        return found[-1]

    def died(
        self, future: Future[Any], victim: int, rule: str, within_s: float = 0
    ) -> WorkerDiedError:
        """``future``'s ``WorkerDiedError`` naming ``victim``, within ``within_s`` or
        ``settle_s``."""
        within_s = within_s or self.settle_s
        try:
            error = future.exception(timeout=within_s)
        except TimeoutError:
            pytest.fail(f"rule broken: {rule}; the call still waits after {within_s:g} s")
        assert isinstance(error, WorkerDiedError), f"rule broken: {rule} (not {error!r})"
        assert victim in error.ranks, f"rule broken: {rule} (naming {error.ranks}, not {victim})"
        return error

    def wait_running(self, executor: Executor, what: str, within_s: float) -> float:
        """Seconds until ``executor`` runs again; fail if it failed, or took over ``within_s``."""
        start, ends = time.monotonic(), (ExecutorState.RUNNING, ExecutorState.FAILED)
        wait_until(lambda: executor.state in ends, within_s, 0.02)
        state, took = executor.state, time.monotonic() - start
        assert state is not ExecutorState.FAILED, (
            f"rule broken: {what}: the executor failed instead of recovering: {executor.failure!r}"
        )
        assert state is ExecutorState.RUNNING, (
            f"rule broken: {what}: the executor is back within {within_s:g} s (state {state} "
            f"after {took:.1f} s)"
        )
        return took

    def hold_last_rank(self, executor: Executor, release: Path) -> Future[list[Any]]:
        """Hold the highest rank in a call until the file ``release`` exists."""
        hold = (str(release), executor.world_size - 1, self.time_limit_s)
        return executor.collective_rpc("hold", args=hold, non_block=True)

    def assert_prompt_shutdown(
        self, executor: Executor, when: str, release: Path | None = None
    ) -> None:
        """Shut ``executor`` down within :attr:`shutdown_s` (a rank held until ``release`` is
        let go then)."""
        timer = threading.Timer(self.shutdown_s, release.touch if release else lambda: None)
        start = time.monotonic()
        timer.start()
        try:
            executor.shutdown()
        finally:
            took = time.monotonic() - start
            timer.cancel()
            if release:
                release.touch()
        assert took < self.shutdown_s, (
            f"rule broken: shutdown() {when} returns within {self.shutdown_s:g} s (took "
            f"{took:.1f} s{'; it waited for the hung rank' if release else ''})"
        )

    @classmethod
    def _shared(cls, factory: ExecutorFactory, **overrides: Any) -> Iterator[Executor]:
        with time_limit(cls.time_limit_s, "creating the executor"):
            executor = factory(**overrides)
        try:
            check_reply_ranks(executor, cls.reply_probe_s(), step_s=0.05)
            yield executor
        finally:
            with time_limit(cls.time_limit_s, "shutdown()"):
                executor.shutdown()

    @pytest.fixture(scope="class")
    @classmethod
    def executor_factory(cls) -> ExecutorFactory:
        """``make(registry=None, **config_overrides) -> Executor`` for the backend."""

        def make(registry: Registry | None = None, **overrides: Any) -> Executor:
            return create_executor(cls.make_config(**overrides), registry)

        return make

    @pytest.fixture(scope="class")
    @classmethod
    def executor(cls, executor_factory: ExecutorFactory) -> Iterator[Executor]:
        """One executor shared by the tests that do not break it."""
        yield from cls._shared(executor_factory)

    @pytest.fixture
    def fresh_executor(self, executor_factory: ExecutorFactory) -> Iterator[ExecutorFactory]:
        """A factory for executors a test may break or shut down; all are shut down after."""
        made: list[Executor] = []

        def make(**overrides: Any) -> Executor:
            executor = executor_factory(**overrides)
            made.append(executor)
            check_reply_ranks(executor, self.reply_probe_s())
            return executor

        try:
            yield make
        finally:
            for executor in made:
                executor.shutdown()

    @pytest.fixture(autouse=True)
    def _time_guard(self, request: pytest.FixtureRequest) -> Iterator[None]:
        with time_limit(self.time_limit_s, request.node.name):
            yield
