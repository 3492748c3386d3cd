"""The asyncio forms of a call (``collective_rpc_async``, ``execute_model_async``), checked on
the ``uni`` backend and on a transport the test drives by hand: sends that wait never block
the loop, a cancelled await withdraws an unsent call or discards a sent one's outcome, and
errors are the synchronous API's."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from executor_core import (
    Executor,
    ExecutorClosedError,
    ExecutorConfig,
    ExecutorFailedError,
    RPCTimeoutError,
    WorkerBase,
    WorkerDiedError,
    WorkerError,
    create_executor,
)
from executor_core.backend import Call, Transport
from executor_core.testing import ConformanceWorker


class _Worker(WorkerBase):
    pass


class _GatedTransport(Transport):
    """Records calls; a send waits while :attr:`gate` is clear; the test delivers replies."""

    last: ClassVar[_GatedTransport | None] = None

    def start(self) -> None:
        self.sent: list[Call] = []
        self.gate = threading.Event()
        self.gate.set()
        _GatedTransport.last = self

    def send(self, call: Call) -> bool:
        self.gate.wait(10)
        self.sent.append(call)
        return True

    def close(self, graceful: bool) -> None:
        self.gate.set()

    def reply(self, call: Call, value: Any) -> None:
        for rank in range(self.host.config.world_size):
            self.host.deliver(call.seq, rank, True, (value, rank))

    def wait_sent(self, count: int) -> None:
        deadline = time.monotonic() + 5
        while len(self.sent) < count:
            assert time.monotonic() < deadline, "the call was never sent"
            time.sleep(0.001)


class _GatedExecutor(Executor):
    transport_cls = _GatedTransport


@pytest.fixture
def gated() -> Iterator[tuple[Executor, _GatedTransport]]:
    config = ExecutorConfig(worker_cls=_Worker, backend=_GatedExecutor, tensor_parallel_size=2)
    executor = _GatedExecutor(config)
    transport = executor.transport
    assert isinstance(transport, _GatedTransport)
    try:
        yield executor, transport
    finally:
        executor.shutdown()


@pytest.fixture
def uni() -> Iterator[Executor]:
    executor = create_executor(ExecutorConfig(backend="uni", worker_cls=ConformanceWorker))
    try:
        yield executor
    finally:
        executor.shutdown()


async def _until(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + 5
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


def _sender_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if "-asyncio" in t.name]


# --- the uni backend -------------------------------------------------------------------------


def test_awaited_results_match_the_blocking_calls(uni: Executor) -> None:
    async def main() -> tuple[Any, ...]:
        return (
            await uni.collective_rpc_async("echo", args=(1,), kwargs={"k": 2}),
            await uni.collective_rpc_async(lambda worker, x: worker.rank + x, args=(5,)),
            await uni.collective_rpc_async("get_rank", timeout=5, unique_reply_rank=0),
            await uni.execute_model_async([1, 2]),
        )

    assert asyncio.run(main()) == (
        uni.collective_rpc("echo", args=(1,), kwargs={"k": 2}),
        [5],
        [0],
        uni.execute_model([1, 2]),
    )


def test_worker_error_is_the_blocking_calls_error(
    uni: Executor, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(WorkerError) as sync_info:
        uni.collective_rpc("fail", args=("boom",), timeout=5)

    async def main() -> None:
        await uni.collective_rpc_async("fail", args=("boom",))

    with caplog.at_level(logging.DEBUG, logger="executor_core"), pytest.raises(WorkerError) as info:
        asyncio.run(main())
    assert str(info.value) == str(sync_info.value)
    assert isinstance(info.value.__cause__, ValueError)
    assert "discarded" not in caplog.text, "an awaited error is raised, not discarded"


def test_invalid_arguments_raise_as_the_blocking_call_does(uni: Executor) -> None:
    with pytest.raises(ValueError, match="timeout"):
        asyncio.run(uni.collective_rpc_async("get_rank", timeout=-1))
    with pytest.raises(ValueError, match="unique_reply_rank"):
        asyncio.run(uni.collective_rpc_async("get_rank", unique_reply_rank=3))
    with pytest.raises(TypeError, match="method"):
        asyncio.run(uni.collective_rpc_async(42))  # type: ignore[arg-type]
    assert asyncio.run(uni.collective_rpc_async("get_rank")) == [0]


def test_shutdown_stops_the_sender_and_later_awaits_raise(uni: Executor) -> None:
    assert asyncio.run(uni.collective_rpc_async("get_rank")) == [0]
    assert _sender_threads()
    uni.shutdown()
    assert not _sender_threads(), "shutdown stops the thread that sends asyncio calls"
    with pytest.raises(ExecutorClosedError):
        asyncio.run(uni.collective_rpc_async("get_rank"))
    with pytest.raises(ExecutorClosedError):
        asyncio.run(uni.execute_model_async(None))


def test_dropped_executor_after_asyncio_calls_is_collected() -> None:
    executor = create_executor(ExecutorConfig(backend="uni", worker_cls=ConformanceWorker))
    assert asyncio.run(executor.collective_rpc_async("get_rank")) == [0]
    ref = weakref.ref(executor)
    del executor
    gc.collect()
    assert ref() is None, "the sender thread must not hold the executor"
    deadline = time.monotonic() + 5
    while _sender_threads():
        assert time.monotonic() < deadline, "a dropped executor's sender thread still runs"
        time.sleep(0.01)


# --- a transport driven by hand ------------------------------------------------------------


def test_a_waiting_send_does_not_block_the_loop(gated: tuple[Executor, _GatedTransport]) -> None:
    executor, transport = gated
    transport.gate.clear()

    async def main() -> list[Any]:
        call = asyncio.ensure_future(executor.collective_rpc_async("m"))
        ticks = 0
        while ticks < 20:  # the loop runs while the send waits
            ticks += 1
            await asyncio.sleep(0.001)
        assert not transport.sent
        transport.gate.set()
        await _until(lambda: transport.sent, "the send")
        transport.reply(transport.sent[0], "v")
        return await call

    assert asyncio.run(main()) == [("v", 0), ("v", 1)]


def test_cancelling_an_unsent_call_withdraws_it(gated: tuple[Executor, _GatedTransport]) -> None:
    executor, transport = gated
    transport.gate.clear()

    async def main() -> list[Any]:
        first = asyncio.ensure_future(executor.collective_rpc_async("first"))
        second = asyncio.ensure_future(executor.collective_rpc_async("second"))
        third = asyncio.ensure_future(executor.collective_rpc_async("third"))
        await asyncio.sleep(0.01)  # the first send waits at the gate; the others are queued
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        transport.gate.set()
        await _until(lambda: len(transport.sent) == 2, "two sends")
        for call in transport.sent:
            transport.reply(call, call.name)
        return [await first, await third]

    assert asyncio.run(main()) == [[("first", 0), ("first", 1)], [("third", 0), ("third", 1)]]
    assert [call.name for call in transport.sent] == ["first", "third"], (
        "a call cancelled before it was sent reaches no rank"
    )
    assert [call.seq for call in transport.sent] == [1, 2]


def test_cancelling_a_sent_call_discards_its_outcome(
    gated: tuple[Executor, _GatedTransport], caplog: pytest.LogCaptureFixture
) -> None:
    executor, transport = gated

    async def main() -> list[Any]:
        cancelled = asyncio.ensure_future(executor.collective_rpc_async("cancelled"))
        later = asyncio.ensure_future(executor.collective_rpc_async("later"))
        await _until(lambda: len(transport.sent) == 2, "two sends")
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        first, second = transport.sent
        # The later call's replies come first; it still completes after the cancelled one.
        transport.reply(second, "later")
        await asyncio.sleep(0.01)
        assert not later.done(), "calls complete in submission order"
        transport.host.deliver(first.seq, 0, False, ValueError("discarded failure"))
        transport.host.deliver(first.seq, 1, True, None)
        result = await later
        await asyncio.sleep(0.01)  # the discarded outcome reaches the loop too
        return result

    with caplog.at_level(logging.DEBUG, logger="executor_core"):
        assert asyncio.run(main()) == [("later", 0), ("later", 1)]
    assert "discarded the error of a cancelled asyncio call" in caplog.text
    assert "discarded failure" in caplog.text


def test_a_call_outlives_its_loop(gated: tuple[Executor, _GatedTransport]) -> None:
    executor, transport = gated

    async def orphan() -> asyncio.Future[list[Any]]:
        call = asyncio.ensure_future(executor.collective_rpc_async("orphan"))
        await _until(lambda: transport.sent, "the send")
        # asyncio.run cancels the task and closes the loop before the reply comes.
        return call

    assert asyncio.run(orphan()).cancelled()
    transport.reply(transport.sent[0], "late")  # nobody waits for it: dropped quietly

    async def next_call() -> list[Any]:
        call = asyncio.ensure_future(executor.collective_rpc_async("next"))
        await _until(lambda: len(transport.sent) == 2, "the send")
        transport.reply(transport.sent[1], "next")
        return await call

    assert asyncio.run(next_call()) == [("next", 0), ("next", 1)]


def test_timeout_raises_rpc_timeout_error(gated: tuple[Executor, _GatedTransport]) -> None:
    executor, _transport = gated
    with pytest.raises(RPCTimeoutError) as info:
        asyncio.run(executor.collective_rpc_async("m", timeout=0.05))
    assert isinstance(info.value, TimeoutError)
    assert tuple(info.value.ranks) == (0, 1)


def test_failure_fails_the_awaits(gated: tuple[Executor, _GatedTransport]) -> None:
    executor, transport = gated

    async def main() -> None:
        call = asyncio.ensure_future(executor.collective_rpc_async("m"))
        await _until(lambda: transport.sent, "the send")
        transport.host.worker_died(WorkerDiedError(1, exitcode=-9))
        with pytest.raises(WorkerDiedError):
            await call
        with pytest.raises(ExecutorFailedError):
            await executor.execute_model_async(None)

    asyncio.run(main())
