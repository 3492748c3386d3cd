"""Behaviour the Executor base class gives every backend (beyond the conformance suite)."""

from __future__ import annotations

import gc
import logging
from concurrent.futures import Future
from typing import Any, ClassVar

import pytest

from executor_core import (
    Executor,
    ExecutorConfig,
    ExecutorError,
    ExecutorFailedError,
    WorkerBase,
    chain_future,
)


class _Worker(WorkerBase):
    pass


class _RecordingExecutor(Executor):
    """A backend with no workers that records what the base class asks of it."""

    events: ClassVar[list[str]] = []
    fail_init: ClassVar[bool] = False

    def _init_executor(self) -> None:
        events = self.events
        self.add_cleanup(lambda: events.append("cleanup"))
        if self.fail_init:
            raise RuntimeError("init failed")

    def collective_rpc(  # type: ignore[override]  # one implementation for both overloads
        self,
        method: Any,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> list[Any] | Future[list[Any]]:
        self.check_open()
        return [method]

    def _shutdown_workers(self) -> None:
        self.events.append("shutdown_workers")


@pytest.fixture(autouse=True)
def _reset_events() -> None:
    _RecordingExecutor.events = []
    _RecordingExecutor.fail_init = False


def _config(**overrides: Any) -> ExecutorConfig:
    return ExecutorConfig(worker_cls=_Worker, backend=_RecordingExecutor, **overrides)


def test_shutdown_runs_workers_then_cleanups_once() -> None:
    executor = _RecordingExecutor(_config())
    executor.shutdown()
    executor.shutdown()
    assert _RecordingExecutor.events == ["shutdown_workers", "cleanup"]


def test_finalizer_runs_cleanups_when_collected() -> None:
    executor = _RecordingExecutor(_config())
    del executor
    gc.collect()
    assert _RecordingExecutor.events == ["cleanup"]


def test_failed_init_releases_everything() -> None:
    _RecordingExecutor.fail_init = True
    with pytest.raises(RuntimeError, match="init failed"):
        _RecordingExecutor(_config())
    assert _RecordingExecutor.events == ["shutdown_workers", "cleanup"]


def test_pipeline_parallel_needs_a_backend_that_supports_it() -> None:
    with pytest.raises(ExecutorError, match="does not support pipeline parallelism"):
        _RecordingExecutor(_config(pipeline_parallel_size=2))


def test_failing_callback_is_logged_and_others_still_run(caplog: pytest.LogCaptureFixture) -> None:
    executor = _RecordingExecutor(_config())
    seen: list[str] = []

    def bad(_error: ExecutorFailedError) -> None:
        raise RuntimeError("callback bug")

    executor.register_failure_callback(bad)
    executor.register_failure_callback(lambda e: seen.append(str(e)))
    with caplog.at_level(logging.ERROR, logger="executor_core"):
        executor.fail(ExecutorFailedError("down"))
    assert seen == ["down"]
    assert "callback bug" in caplog.text
    executor.shutdown()


def test_no_callbacks_after_shutdown() -> None:
    executor = _RecordingExecutor(_config())
    seen: list[ExecutorFailedError] = []
    executor.register_failure_callback(seen.append)
    executor.shutdown()
    assert executor.fail(ExecutorFailedError("late")) is False
    assert seen == []


def test_max_concurrent_batches() -> None:
    assert _RecordingExecutor(_config()).max_concurrent_batches == 1
    assert _RecordingExecutor(_config(async_scheduling=True)).max_concurrent_batches == 2


def test_chain_future_passes_results_and_errors() -> None:
    source: Future[int] = Future()
    doubled = chain_future(source, lambda v: v * 2)
    source.set_result(21)
    assert doubled.result(timeout=1) == 42
    failing: Future[int] = Future()
    chained = chain_future(failing, lambda v: v)
    failing.set_exception(KeyError("k"))
    with pytest.raises(KeyError):
        chained.result(timeout=1)
