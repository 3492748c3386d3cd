"""What every area of the conformance kit shares: the backend under test, its configs, the
fixtures that build executors, and the time guard around each test."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest

from .._config import ExecutorConfig
from .._errors import RPCTimeoutError
from .._executor import Executor, create_executor
from .._registry import BackendSpec, Registry, default_registry
from ._guard import time_limit
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


def check_reply_ranks(executor: Executor, timeout: float) -> None:
    """Fail, naming the rule, unless every rank's reply comes back labelled with its rank.

    Each worker returns its own rank (``get_rank``), so a reply delivered under another
    rank's number shows as a result out of place; one whose true rank never answers would
    leave the call waiting: the call has a ``timeout`` so that this fails at once, saying
    why, rather than as a hang in a later test.
    """
    try:
        ranks = executor.collective_rpc("get_rank", timeout=timeout)
    except RPCTimeoutError as exc:
        raise AssertionError(
            f"rule broken: replies carry the rank they came from; ranks {list(exc.ranks)} "
            f"never answered get_rank as themselves within {timeout:g} s (a reply delivered "
            "with another rank's number is not that rank's: deliver(seq, rank, ...) with the "
            "rank that ran the call)"
        ) from exc
    wrong = [
        f"the reply in rank {rank}'s place came from rank {got}"
        for rank, got in enumerate(ranks)
        if got != rank
    ]
    assert not wrong, (
        f"rule broken: replies carry the rank they came from: {'; '.join(wrong)} (deliver "
        "each reply with the rank that ran the call)"
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
    #: Nodes of every executor whose world size is a multiple of it (the others run on
    #: one): a backend that places its own nodes (``mp``'s launcher contract, say) runs the
    #: whole kit across several with ``num_nodes = 2``.
    num_nodes: ClassVar[int] = 1
    #: ``backend_options`` of every executor the kit builds.
    backend_options: ClassVar[dict[str, Any]] = {}
    #: Seconds one test may take, start-up and shutdown included: past it the test fails
    #: (a hang is a failure, not a long wait for an outer timeout).
    time_limit_s: ClassVar[float] = 60.0
    #: Seconds workers, threads and descriptors get to go after shutdown or a drop.
    settle_s: ClassVar[float] = 10.0
    #: Seconds a slow call sleeps in the timeout tests; the timeout is a fraction of it.
    slow_call_s: ClassVar[float] = 1.0
    #: Name prefixes of threads the backend keeps for its session across executors (a
    #: cluster client's); any other thread left after shutdown is a leak.
    session_threads: ClassVar[tuple[str, ...]] = ()
    #: False if the backend's session keeps descriptors across executors (a cluster
    #: client's sockets), so that descriptors cannot be attributed to one executor.
    check_fds: ClassVar[bool] = True
    #: True if every worker runs in a process of its own (not the driver's), so that the kit
    #: may kill one by the pid it reports (``ConformanceWorker.get_pid``) and check that its
    #: death is reported. Process backends set it; thread and in-process backends leave it.
    workers_are_processes: ClassVar[bool] = False
    #: Seconds ``shutdown()`` may take with a rank hung in a call: the backend's own grace
    #: periods before it stops the rank by force.
    shutdown_s: ClassVar[float] = 30.0
    #: Bytes of a call that no queue or ring of the backend holds whole (``mp``'s broadcast
    #: ring holds 64 MiB at its defaults): with a rank hung, such a call cannot be sent, and
    #: must still fail by its deadline. Raise it if your backend buffers more.
    large_call_bytes: ClassVar[int] = 80 << 20
    #: Name prefixes of entries in ``tempfile.gettempdir()`` that outlive an executor on
    #: purpose (a cluster client's session directory); any other is a leak.
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

    def assert_prompt_shutdown(self, executor: Executor, when: str) -> None:
        """Shut ``executor`` down; fail unless it returned within :attr:`shutdown_s`."""
        start = time.monotonic()
        executor.shutdown()
        took = time.monotonic() - start
        assert took < self.shutdown_s, (
            f"rule broken: shutdown() {when} returns within {self.shutdown_s:g} s "
            f"(took {took:.1f} s)"
        )

    @classmethod
    def spec(cls) -> BackendSpec | None:
        """The backend's declaration in the registry (None for an unregistered class)."""
        backend = cls.backend
        if isinstance(backend, str) and backend and ":" not in backend:
            return default_registry().get(backend)
        return None

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
        with time_limit(cls.time_limit_s, "creating the executor"):
            executor = executor_factory()
        try:
            check_reply_ranks(executor, cls.reply_probe_s())
            yield executor
        finally:
            with time_limit(cls.time_limit_s, "shutdown()"):
                executor.shutdown()

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
