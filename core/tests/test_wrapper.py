"""WorkerWrapper in-process: method resolution, failure records, worker-side hooks."""

from __future__ import annotations

import pickle
from typing import Any

import cloudpickle
import pytest

from executor_core import WorkerBase, WorkerContext, hookimpl
from executor_core._wrapper import dumps_method
from executor_core.backend import Registry, RemoteFailure, WorkerWrapper
from executor_core.testing import ConformanceWorker


def _context(rank: int = 0) -> WorkerContext:
    return WorkerContext(
        rank=rank,
        local_rank=rank,
        world_size=2,
        tensor_parallel_size=2,
        pipeline_parallel_size=1,
        distributed_init_method="tcp://127.0.0.1:1",
        backend="test",
    )


class _Observer:
    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    @hookimpl
    def executor_worker_process_started(self, context: WorkerContext) -> None:
        self.events.append(("started", context.rank))

    @hookimpl
    def executor_worker_ready(self, worker: WorkerBase, context: WorkerContext) -> None:
        self.events.append(("ready", type(worker).__name__))

    @hookimpl
    def executor_worker_rpc_finished(
        self, context: WorkerContext, method: str, duration_s: float, error: BaseException | None
    ) -> None:
        assert duration_s >= 0
        self.events.append(("rpc", method, None if error is None else type(error).__name__))

    @hookimpl
    def executor_worker_stopping(self, worker: WorkerBase | None, context: WorkerContext) -> None:
        self.events.append(("stopping", worker is not None))


@pytest.fixture
def observed() -> tuple[WorkerWrapper, _Observer]:
    registry = Registry()
    observer = _Observer()
    assert registry.register_plugin(observer, "observer")
    wrapper = WorkerWrapper(
        "executor_core.testing:ConformanceWorker",
        {"tag": "t"},
        _context(rank=1),
        env={"EXECUTOR_WRAPPER_TEST": "1"},
        hooks=registry.hook,
    )
    return wrapper, observer


def test_lifecycle_and_hooks(
    observed: tuple[WorkerWrapper, _Observer], monkeypatch: pytest.MonkeyPatch
) -> None:
    wrapper, observer = observed
    monkeypatch.delenv("EXECUTOR_WRAPPER_TEST", raising=False)
    wrapper.init_worker()
    assert isinstance(wrapper.worker, ConformanceWorker)
    assert wrapper.run_method("get_tag") == "t"
    assert wrapper.run_method("get_env", ("EXECUTOR_WRAPPER_TEST",)) == "1"
    ok, failure = wrapper.handle("fail", ("boom",))  # type: ignore[misc]  # a failure
    assert not ok
    assert isinstance(failure, RemoteFailure)
    assert failure.rank == 1
    wrapper.shutdown()
    wrapper.shutdown()  # once only
    assert observer.events == [
        ("started", 1),
        ("ready", "ConformanceWorker"),
        ("rpc", "get_tag", None),
        ("rpc", "get_env", None),
        ("rpc", "fail", "ValueError"),
        ("stopping", True),
        ("stopping", False),
    ]


def test_callables_plain_and_pickled(observed: tuple[WorkerWrapper, _Observer]) -> None:
    wrapper, _ = observed
    wrapper.init_worker()
    offset = 10
    assert wrapper.run_method(lambda w, x: w.rank + x + offset, (5,)) == 16
    pickled = dumps_method(lambda w: w.rank * 100)
    assert isinstance(pickled, bytes)
    assert wrapper.run_method(pickled) == 100
    assert dumps_method("name") == "name"
    with pytest.raises(TypeError, match="method must be"):
        dumps_method(42)  # type: ignore[arg-type]  # the wrong type is the point of the test


def test_unknown_method_and_uninitialised(observed: tuple[WorkerWrapper, _Observer]) -> None:
    wrapper, _ = observed
    with pytest.raises(RuntimeError, match="not initialised"):
        wrapper.run_method("get_rank")
    wrapper.init_worker()
    ok, failure = wrapper.handle("nope")  # type: ignore[misc]  # a failure
    assert not ok
    assert "no method 'nope'" in failure.message
    error = pickle.loads(pickle.dumps(failure)).to_error()
    assert isinstance(error.__cause__, AttributeError)


def test_bad_worker_class() -> None:
    wrapper = WorkerWrapper("executor_core:ExecutorConfig", {}, _context(), hooks=Registry().hook)
    with pytest.raises(TypeError, match="not a WorkerBase subclass"):
        wrapper.init_worker()
    missing = WorkerWrapper("executor_core:NoSuchWorker", {}, _context(), hooks=Registry().hook)
    with pytest.raises(ImportError, match="has no attribute"):
        missing.init_worker()


def test_unexpected_worker_kwargs_are_named() -> None:
    with pytest.raises(TypeError, match=r"unexpected worker_kwargs \['colour'\]"):
        WorkerBase(context=_context(), colour="red")


def test_cloudpickle_is_what_ships_callables() -> None:
    def closure(worker: WorkerBase) -> int:
        return worker.rank

    assert cloudpickle.loads(dumps_method(closure))  # by value, even for a local function
