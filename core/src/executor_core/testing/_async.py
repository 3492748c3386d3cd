"""Conformance kit, asyncio: ``collective_rpc_async`` and ``execute_model_async`` under load,
with errors, timeouts, cancellation and several event loops."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from .._errors import RPCTimeoutError, WorkerError
from .._executor import Executor
from ._base import KitBase

__all__ = ["AsyncTests"]

T = TypeVar("T")


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def _echoed(executor: Executor, args: tuple[Any, ...], rank: int | None = None) -> list[Any]:
    """What ``echo(*args)`` returns (from every rank, or only ``rank``)."""
    ranks = range(executor.world_size) if rank is None else [rank]
    return [(r, args, {}) for r in ranks]


class AsyncTests(KitBase):
    """``await executor.collective_rpc_async(...)`` and ``execute_model_async``: every call
    gets its own result, errors are the synchronous API's, and cancelling an await never
    puts the ranks out of step."""

    def test_async_many_concurrent_awaits(self, executor: Executor) -> None:
        last = executor.world_size - 1

        async def one(i: int) -> tuple[int, list[Any]]:
            if i % 3 == 2:
                return i, await executor.collective_rpc_async(
                    "echo", args=(i,), unique_reply_rank=last
                )
            return i, await executor.collective_rpc_async("echo", args=(i,))

        async def main() -> list[tuple[int, list[Any]]]:
            return await asyncio.gather(*(one(i) for i in range(200)))

        for i, result in _run(main()):
            expected = _echoed(executor, (i,), last if i % 3 == 2 else None)
            assert result == expected, (
                f"rule broken: each await gets its own call's results (call {i} got {result})"
            )

    def test_async_calls_run_in_the_order_they_start(self, executor: Executor) -> None:
        executor.collective_rpc("clear_recorded")

        async def main() -> list[list[Any]]:
            return await asyncio.gather(
                *(executor.collective_rpc_async("record", args=(i,)) for i in range(30))
            )

        assert _run(main()) == [[i + 1] * executor.world_size for i in range(30)]
        assert executor.collective_rpc("get_recorded") == [list(range(30))] * executor.world_size

    def test_execute_model_async(self, executor: Executor) -> None:
        async def main() -> list[Any]:
            return await asyncio.gather(*(executor.execute_model_async(i) for i in range(20)))

        outputs = _run(main())
        assert [out["batch"] for out in outputs] == list(range(20))
        assert {out["rank"] for out in outputs} == {executor.output_rank}, (
            "rule broken: execute_model_async returns the output rank's result"
        )

    def test_async_await_does_not_block_the_loop(self, executor: Executor) -> None:
        async def main() -> int:
            ticks = 0
            call = asyncio.ensure_future(executor.collective_rpc_async("slow", args=(0.3,)))
            while not call.done():
                ticks += 1
                await asyncio.sleep(0.01)
            assert await call == [(r, None) for r in range(executor.world_size)]
            return ticks

        ticks = _run(main())
        assert ticks >= 5, f"rule broken: the event loop runs while a call is awaited ({ticks})"

    def test_async_worker_error(self, executor: Executor) -> None:
        bad = executor.world_size - 1
        sync_error = executor.collective_rpc(
            "fail", args=("async kaboom",), kwargs={"on_rank": bad}, non_block=True
        ).exception(timeout=30)

        async def main() -> WorkerError:
            with pytest.raises(WorkerError) as info:
                await executor.collective_rpc_async(
                    "fail", args=("async kaboom",), kwargs={"on_rank": bad}
                )
            return info.value

        err = _run(main())
        assert err.rank == bad
        assert err.method == "fail"
        assert err.exc_type == "ValueError"
        assert "async kaboom" in err.message
        assert "in fail" in err.remote_traceback
        assert "raise ValueError" in err.remote_traceback
        assert str(err) == str(sync_error), (
            "rule broken: an awaited call's WorkerError reads as the synchronous API's"
        )
        assert executor.collective_rpc("get_rank") == list(range(executor.world_size))

    def test_async_timeout(self, executor: Executor) -> None:
        slow = self.slow_call_s / 2

        async def main() -> RPCTimeoutError:
            with pytest.raises(RPCTimeoutError) as info:
                await executor.collective_rpc_async("slow", args=(slow,), timeout=slow / 5)
            return info.value

        start = time.monotonic()
        err = _run(main())
        assert time.monotonic() - start < slow * 0.9, "rule broken: timeout fires on time"
        assert isinstance(err, TimeoutError)
        assert err.method == "slow"
        assert err.ranks, "the error must name the ranks that did not answer"
        assert _run(executor.collective_rpc_async("echo", args=("after",))) == _echoed(
            executor, ("after",)
        ), "rule broken: after a timeout the next call gets its own results, not late ones"

    def test_async_cancel_keeps_ranks_in_step(self, executor: Executor) -> None:
        ws = executor.world_size
        executor.collective_rpc("clear_recorded")
        slow = 0.3

        async def main() -> list[list[Any]]:
            loop = asyncio.get_running_loop()
            call = asyncio.ensure_future(
                executor.collective_rpc_async("record_slowly", args=("cancelled", slow))
            )
            await asyncio.sleep(slow / 3)  # sent: the workers are running it
            start = loop.time()
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            assert loop.time() - start < slow / 3, "the awaiter is cancelled at once"
            # An asyncio timeout is a cancellation too.
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(
                    executor.collective_rpc_async("record_slowly", args=("timed out", 0.0)),
                    timeout=0.01,
                )
            return await asyncio.gather(
                *(executor.collective_rpc_async("record", args=(i,)) for i in range(10))
            )

        results = _run(main())
        recorded = executor.collective_rpc("get_recorded")
        assert recorded[0][:1] == ["cancelled"], (
            "rule broken: a sent call runs on every rank even if its await is cancelled"
        )
        assert recorded[0][-10:] == list(range(10))
        # The call cancelled by wait_for was sent (it ran) or withdrawn (it did not), on every
        # rank alike.
        assert recorded[0][1:-10] in ([], ["timed out"])
        assert recorded == [recorded[0]] * ws, "rule broken: the ranks ran different calls"
        ahead = len(recorded[0]) - 10
        assert results == [[ahead + i + 1] * ws for i in range(10)], (
            "rule broken: after a cancelled await, every later call gets its own results"
        )

    def test_async_from_two_loops_in_two_threads(self, executor: Executor) -> None:
        results: dict[str, Any] = {}

        async def main(tag: str) -> None:
            calls = [executor.collective_rpc_async("echo", args=(tag, i)) for i in range(50)]
            got = await asyncio.gather(*calls, executor.execute_model_async(tag))
            results[tag] = (got, asyncio.get_running_loop())

        def run(tag: str) -> None:
            try:
                _run(main(tag))
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                results[tag] = exc

        threads = [threading.Thread(target=run, args=(tag,)) for tag in ("a", "b")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        for tag in ("a", "b"):
            outcome = results.get(tag)
            assert isinstance(outcome, tuple), f"the loop of thread {tag!r} got {outcome!r}"
            got = outcome[0]
            assert got[:-1] == [_echoed(executor, (tag, i)) for i in range(50)]
            assert got[-1]["batch"] == tag
        assert results["a"][1] is not results["b"][1]
