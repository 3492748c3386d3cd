"""What every area of the kit shares: the backend under test, its configs, the fixtures that
build executors, the time guard around each test, and the worker processes it may kill."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from executor_core import Executor, ExecutorConfig, RPCTimeoutError, create_executor
from executor_core.backend import BackendSpec, Registry, default_registry

from ._guard import process_identity, time_limit
from ._workers import ConformanceWorker

__all__ = ["ExecutorFactory", "KitBase", "check_reply_ranks", "conformance_config"]

#: Builds a started executor: ``make(registry=None, **config_overrides)``.
ExecutorFactory = Callable[..., Executor]


def conformance_config(backend: str | type, **overrides: Any) -> ExecutorConfig:
    """An ExecutorConfig that runs :class:`ConformanceWorker` on ``backend``.

    ``world_size=N`` is accepted as a shorthand for ``tensor_parallel_size=N`` (divided by
    ``pipeline_parallel_size`` when that is given).
    """
    world_size = overrides.pop("world_size", None)
    if world_size is not None and "tensor_parallel_size" not in overrides:
        overrides["tensor_parallel_size"] = world_size // overrides.get("pipeline_parallel_size", 1)
    overrides.setdefault("worker_cls", ConformanceWorker)
    return ExecutorConfig(backend=backend, **overrides)


def check_reply_ranks(executor: Executor, timeout: float, step_s: float = 0.0) -> None:
    """Fail, naming the rule, unless every rank's reply comes back labelled with its rank.

    Each worker returns its own rank; with ``step_s`` the highest rank answers first
    (``rank_in_reverse``), so that replies labelled by their order of arrival show. A reply
    under another rank's number leaves the true rank's place empty: the call has a
    ``timeout`` so that this fails at once rather than as a hang in a later test.
    """
    method, args = ("rank_in_reverse", (step_s,)) if step_s else ("get_rank", ())
    try:
        ranks = executor.collective_rpc(method, args=args, timeout=timeout)
    except RPCTimeoutError as exc:
        raise AssertionError(
            f"rule broken: replies carry the rank they came from; ranks {list(exc.ranks)} "
            f"never answered {method} as themselves within {timeout:g} s (deliver(seq, rank, "
            "...) with the rank that ran the call)"
        ) from exc
    wrong = [f"rank {r}'s place holds {got!r}" for r, got in enumerate(ranks) if got != r]
    assert len(ranks) == executor.world_size, f"rule broken: one result per rank, not {ranks}"
    assert not wrong, (
        f"rule broken: replies carry the rank they came from, one per rank in rank order: "
        f"{ranks} ({'; '.join(wrong)}; deliver each reply with the rank that ran the call, "
        "whatever order replies arrive in)"
    )


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
    #: False if the backend's session keeps descriptors across executors (a cluster client's
    #: sockets), so that descriptors cannot be attributed to one executor.
    check_fds: ClassVar[bool] = True
    #: Seconds ``shutdown()`` may take with a rank hung in a call (the backend's grace
    #: periods before it stops the rank by force).
    shutdown_s: ClassVar[float] = 30.0
    #: Bytes of a call that no queue or ring of the backend holds whole (``mp``'s broadcast
    #: ring holds 64 MiB at its defaults): with a rank hung it must still fail by its deadline.
    large_call_bytes: ClassVar[int] = 80 << 20
    #: Name prefixes of entries in ``tempfile.gettempdir()`` that outlive an executor on
    #: purpose (a cluster client's session directory).
    session_temp_files: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def make_config(cls, **overrides: Any) -> ExecutorConfig:
        """The config of an executor under test, with ``overrides`` applied."""
        if not cls.backend:
            raise TypeError(
                f"{cls.__name__} must set backend = '<your backend name>' (or override "
                "the executor_factory fixture)"
            )
        pp = overrides.pop("pipeline_parallel_size", cls.pipeline_parallel_size)
        world_size = overrides.pop("world_size", cls.world_size)
        if "num_nodes" not in overrides and world_size % cls.num_nodes == 0:
            overrides["num_nodes"] = cls.num_nodes
        options = {**cls.backend_options, **overrides.pop("backend_options", {})}
        return conformance_config(
            cls.backend,
            world_size=world_size,
            pipeline_parallel_size=pp,
            backend_options=options,
            **overrides,
        )

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
        """Each rank's pid where its worker runs in a process of its own on this machine
        (one the kit may kill, stop and inspect: its ``process_identity`` is the same seen
        from here), else None (the driver's process, or out of reach)."""
        found = executor.collective_rpc("get_process", timeout=self.reply_probe_s())
        mine = os.getpid()
        return [p if p != mine and who and who == process_identity(p) else None for p, who in found]

    def victim(self, pids: list[int | None], avoid: Iterable[int | None] = ()) -> tuple[int, int]:
        """``(rank, pid)`` of the highest rank of ``pids`` (:meth:`worker_processes`) in a
        process of its own, not one of ``avoid``; the test is skipped where there is none."""
        avoid = set(avoid)
        found = [(r, pid) for r, pid in enumerate(pids) if pid is not None and pid not in avoid]
        if not found:
            pytest.skip("no rank runs in a worker process of its own on this machine")
        return found[-1]

    def assert_prompt_shutdown(
        self, executor: Executor, when: str, release: Path | None = None
    ) -> None:
        """Shut ``executor`` down; fail unless it returned within :attr:`shutdown_s`. A rank
        held by ``hold(release, ...)`` is let go once that bound has passed (or after)."""
        timer = threading.Timer(self.shutdown_s, release.touch) if release else None
        start = time.monotonic()
        if timer:
            timer.start()
        try:
            executor.shutdown()
        finally:
            took = time.monotonic() - start
            if timer and release:
                timer.cancel()
                timer.join()
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
