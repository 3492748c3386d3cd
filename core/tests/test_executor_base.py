"""The rules of a call, owned by the core, checked against a transport the test drives by hand.

The transport records what the core sends and the test delivers replies itself, so every rule
(order, gathering, lowest failing rank, timeouts, failure, shutdown, cleanup) is exercised
without any worker.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any, ClassVar

import pytest

from executor_core import (
    Executor,
    ExecutorClosedError,
    ExecutorConfig,
    ExecutorError,
    ExecutorFailedError,
    RPCTimeoutError,
    WorkerBase,
    WorkerDiedError,
    WorkerError,
    create_executor,
)
from executor_core._executor import chain_future
from executor_core.backend import Call, RemoteFailure, Transport, TransportHost


class _Worker(WorkerBase):
    pass


class _ManualTransport(Transport):
    """Records calls; replies come from the test through ``host.deliver``."""

    events: ClassVar[list[str]] = []
    fail_start: ClassVar[bool] = False
    last: ClassVar[_ManualTransport | None] = None

    def __init__(self, host: TransportHost) -> None:
        super().__init__(host)
        self.sent: list[Call] = []
        _ManualTransport.last = self

    def start(self) -> None:
        events = self.events
        self.host.add_cleanup(lambda: events.append("cleanup"))
        if self.fail_start:
            raise RuntimeError("start failed")

    def send(self, call: Call) -> bool:
        self.sent.append(call)
        return True

    def close(self, graceful: bool) -> None:
        self.events.append(f"close graceful={graceful}")

    def reply_all(self, call: Call, value: Any = None) -> None:
        for rank in range(self.host.config.world_size):
            self.host.deliver(call.seq, rank, True, value if value is not None else rank)


class _ManualExecutor(Executor):
    transport_cls = _ManualTransport


@pytest.fixture(autouse=True)
def _reset() -> None:
    _ManualTransport.events = []
    _ManualTransport.fail_start = False


def _config(**overrides: Any) -> ExecutorConfig:
    overrides.setdefault("tensor_parallel_size", 2)
    return ExecutorConfig(worker_cls=_Worker, backend=_ManualExecutor, **overrides)


def _transport(executor: Executor) -> _ManualTransport:
    transport = executor.transport
    assert isinstance(transport, _ManualTransport)
    return transport


def _call_in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the test through out
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _wait_sent(transport: _ManualTransport, count: int) -> None:
    deadline = time.monotonic() + 5
    while len(transport.sent) < count:
        assert time.monotonic() < deadline, "the call was never sent"
        time.sleep(0.001)


# --- lifecycle -------------------------------------------------------------------------------


def test_shutdown_closes_the_transport_then_cleans_up_once() -> None:
    executor = _ManualExecutor(_config())
    executor.shutdown()
    executor.shutdown()
    assert _ManualTransport.events == ["close graceful=True", "cleanup"]


def test_dropped_executor_is_collected_and_cleaned_up() -> None:
    executor = _ManualExecutor(_config())
    ref = weakref.ref(executor)
    del executor
    gc.collect()
    assert ref() is None
    assert _ManualTransport.events == ["close graceful=False", "cleanup"]


def test_failed_start_releases_everything() -> None:
    _ManualTransport.fail_start = True
    with pytest.raises(RuntimeError, match="start failed"):
        _ManualExecutor(_config())
    assert _ManualTransport.events == ["close graceful=False", "cleanup"]


def test_an_executor_class_without_a_transport_is_refused() -> None:
    class NoTransport(Executor):
        pass

    with pytest.raises(TypeError, match="transport_cls"):
        NoTransport(ExecutorConfig(worker_cls=_Worker, backend=NoTransport))


def test_max_concurrent_batches() -> None:
    with _ManualExecutor(_config()) as executor:
        assert executor.max_concurrent_batches == 1
    with _ManualExecutor(_config(async_scheduling=True)) as executor:
        assert executor.max_concurrent_batches == 2


# --- gathering -------------------------------------------------------------------------------


def test_results_in_rank_order_whatever_the_reply_order() -> None:
    with _ManualExecutor(_config()) as executor:
        transport = _transport(executor)
        thread, out = _call_in_thread(lambda: executor.collective_rpc("m"))
        _wait_sent(transport, 1)
        call = transport.sent[0]
        transport.host.deliver(call.seq, 1, True, "one")
        transport.host.deliver(call.seq, 0, True, "zero")
        thread.join(5)
        assert out == [["zero", "one"]]


def test_lowest_failing_rank_wins_whatever_the_reply_order() -> None:
    with _ManualExecutor(_config(tensor_parallel_size=3)) as executor:
        transport = _transport(executor)
        thread, out = _call_in_thread(lambda: executor.collective_rpc("m"))
        _wait_sent(transport, 1)
        seq = transport.sent[0].seq
        transport.host.deliver(seq, 2, False, ValueError("rank two"))
        transport.host.deliver(seq, 0, True, 0)
        assert thread.is_alive(), "the call must wait for every expected rank"
        transport.host.deliver(seq, 1, False, RemoteFailure.capture(1, "m", KeyError("one")))
        thread.join(5)
        [error] = out
        assert isinstance(error, WorkerError)
        assert error.rank == 1
        assert executor.collective_rpc("m", non_block=True) is not None  # still usable


def test_a_failure_from_a_rank_that_was_not_asked_to_reply_completes_the_call() -> None:
    with _ManualExecutor(_config()) as executor:
        transport = _transport(executor)
        thread, out = _call_in_thread(lambda: executor.collective_rpc("m", unique_reply_rank=1))
        _wait_sent(transport, 1)
        call = transport.sent[0]
        assert call.reply_rank == 1
        transport.host.deliver(call.seq, 0, False, ValueError("boom"))
        thread.join(5)
        [error] = out
        assert isinstance(error, WorkerError)
        assert error.rank == 0


def test_calls_complete_in_submission_order() -> None:
    with _ManualExecutor(_config()) as executor:
        transport = _transport(executor)
        first = executor.collective_rpc("a", non_block=True)
        second = executor.collective_rpc("b", non_block=True)
        order: list[str] = []
        first.add_done_callback(lambda _f: order.append("a"))
        second.add_done_callback(lambda _f: order.append("b"))
        transport.reply_all(transport.sent[1])
        assert not second.done(), "a later call must not complete before an earlier one"
        transport.reply_all(transport.sent[0])
        assert first.result(5) == [0, 1]
        assert second.result(5) == [0, 1]
        assert order == ["a", "b"]


def test_sequence_numbers_give_one_order_to_every_thread() -> None:
    with _ManualExecutor(_config()) as executor:
        transport = _transport(executor)
        futures = []
        lock = threading.Lock()

        def caller() -> None:
            for _ in range(50):
                future = executor.collective_rpc("m", non_block=True)
                with lock:
                    futures.append(future)

        threads = [threading.Thread(target=caller) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert [c.seq for c in transport.sent] == list(range(1, 201))
        for call in transport.sent:
            transport.reply_all(call)
        assert all(f.result(5) == [0, 1] for f in futures)


# --- timeouts --------------------------------------------------------------------------------


def test_blocking_timeout_names_the_silent_ranks_and_drops_late_replies() -> None:
    with _ManualExecutor(_config()) as executor:
        transport = _transport(executor)
        thread, out = _call_in_thread(lambda: executor.collective_rpc("m", timeout=0.2))
        _wait_sent(transport, 1)
        late = transport.sent[0]
        transport.host.deliver(late.seq, 0, True, 0)
        thread.join(5)
        [error] = out
        assert isinstance(error, RPCTimeoutError)
        assert error.ranks == (1,)
        transport.host.deliver(late.seq, 1, True, "late")  # dropped
        future = executor.collective_rpc("m", non_block=True)
        transport.reply_all(transport.sent[1])
        assert future.result(5) == [0, 1]


def test_non_blocking_timeout_fails_the_future_on_time() -> None:
    with _ManualExecutor(_config()) as executor:
        start = time.monotonic()
        future = executor.collective_rpc("m", timeout=0.2, non_block=True)
        with pytest.raises(RPCTimeoutError) as info:
            future.result(5)
        assert time.monotonic() - start < 1.5
        assert info.value.ranks == (0, 1)


def test_a_timeout_names_the_failure_that_a_rank_already_answered_with() -> None:
    """Rank 0 fails at once (it cannot host the rendezvous, say) while rank 1 waits for it:
    the timeout says what rank 0 raised, in both the blocking and the non-blocking form."""
    failure = RemoteFailure.capture(0, "m", OSError("address already in use"))
    with _ManualExecutor(_config()) as executor:
        transport = _transport(executor)
        thread, out = _call_in_thread(lambda: executor.collective_rpc("m", timeout=0.3))
        _wait_sent(transport, 1)
        transport.host.deliver(transport.sent[0].seq, 0, False, failure)
        future = executor.collective_rpc("m", timeout=0.3, non_block=True)
        transport.host.deliver(transport.sent[1].seq, 0, False, failure)
        thread.join(5)
        with pytest.raises(RPCTimeoutError) as info:
            future.result(5)
        for error in (out[0], info.value):
            assert isinstance(error, RPCTimeoutError)
            assert error.ranks == (1,)
            assert "rank 0 had failed the call" in str(error)
            assert "OSError" in str(error)
            assert "address already in use" in str(error)
            assert isinstance(error.failed, WorkerError)
            assert error.failed.rank == 0
            assert error.__cause__ is error.failed


def test_invalid_arguments_are_refused_before_sending() -> None:
    with _ManualExecutor(_config()) as executor:
        with pytest.raises(ValueError, match="timeout"):
            executor.collective_rpc("m", timeout=0)
        with pytest.raises(ValueError, match="unique_reply_rank"):
            executor.collective_rpc("m", unique_reply_rank=2)
        with pytest.raises(TypeError, match="method"):
            executor.collective_rpc(42)  # type: ignore[call-overload]  # the point of the test
        with pytest.raises(TypeError, match="kwargs"):
            executor.collective_rpc("m", kwargs=[1])  # type: ignore[call-overload]  # as above
        assert _transport(executor).sent == []


# --- failure and shutdown -------------------------------------------------------------------


def test_worker_death_fails_calls_in_flight_and_later_calls() -> None:
    with _ManualExecutor(_config()) as executor:
        transport = _transport(executor)
        seen: list[ExecutorFailedError] = []
        executor.register_failure_callback(seen.append)
        pending = executor.collective_rpc("m", non_block=True)
        thread, out = _call_in_thread(lambda: executor.collective_rpc("m"))
        _wait_sent(transport, 2)
        died = WorkerDiedError(1, exitcode=9)
        transport.host.worker_died(died)
        transport.host.worker_died(WorkerDiedError(0))  # a second report changes nothing
        thread.join(5)
        assert out == [died]
        with pytest.raises(WorkerDiedError):
            pending.result(5)
        with pytest.raises(WorkerDiedError):
            executor.collective_rpc("m")
        assert seen == [died]
        assert executor.is_failed


def test_shutdown_fails_calls_in_flight_with_executor_closed() -> None:
    executor = _ManualExecutor(_config())
    pending = executor.collective_rpc("m", non_block=True)
    executor.shutdown()
    with pytest.raises(ExecutorClosedError):
        pending.result(5)
    with pytest.raises(ExecutorClosedError):
        executor.collective_rpc("m")


def test_failure_callbacks_run_once_and_late_ones_at_once() -> None:
    with _ManualExecutor(_config()) as executor:
        calls: list[ExecutorFailedError] = []
        executor.register_failure_callback(calls.append)
        error = ExecutorFailedError("simulated")
        assert executor.fail(error) is True
        assert executor.fail(ExecutorFailedError("second")) is False
        late: list[ExecutorFailedError] = []
        executor.register_failure_callback(late.append)
        assert calls == [error]
        assert late == [error]


def test_failing_callback_is_logged_and_others_still_run(caplog: pytest.LogCaptureFixture) -> None:
    executor = _ManualExecutor(_config())
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
    executor = _ManualExecutor(_config())
    seen: list[ExecutorFailedError] = []
    executor.register_failure_callback(seen.append)
    executor.shutdown()
    assert executor.fail(ExecutorFailedError("late")) is False
    assert seen == []


def test_fail_takes_an_executor_failed_error() -> None:
    with _ManualExecutor(_config()) as executor, pytest.raises(TypeError):
        executor.fail(ExecutorError("not a failure"))  # type: ignore[arg-type]  # the point


def test_config_env_is_restored_in_the_driver() -> None:
    name = "EXECUTOR_TEST_CORE_ENV"
    os.environ.pop(name, None)
    executor = _ManualExecutor(_config(env={name: "x"}))
    os.environ[name] = "x"  # what an in-process worker does
    executor.shutdown()
    assert name not in os.environ


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


def test_capabilities_are_enforced_from_the_backend_spec() -> None:
    config = ExecutorConfig(worker_cls=_Worker, backend="uni", pipeline_parallel_size=2)
    with pytest.raises(ExecutorError, match="does not support pipeline parallelism"):
        create_executor(config)
    with pytest.raises(ExecutorError, match="at most 1 worker"):
        create_executor(config.evolve(pipeline_parallel_size=1, tensor_parallel_size=2))
