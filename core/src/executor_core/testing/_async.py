"""asyncio: ``collective_rpc_async`` and ``execute_model_async`` under load, with errors,
timeouts, cancellation and several event loops."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from executor_core import Executor, RPCTimeoutError, WorkerError

from ._base import KitBase
from ._calls import echoed, usable_after

__all__ = ["AsyncTests"]


class AsyncTests(KitBase):
    """``await executor.collective_rpc_async(...)`` and ``execute_model_async``: every call
    gets its own result, errors are the synchronous API's, and cancelling an await never
    puts the ranks out of step."""

    def test_async_many_concurrent_awaits(self, executor: Executor) -> None:
        last = executor.world_size - 1

        async def one(i: int) -> list[Any]:
            reply_rank = last if i % 3 == 2 else None
            return await executor.collective_rpc_async(
                "echo", args=(i,), unique_reply_rank=reply_rank
            )

        async def main() -> list[list[Any]]:
            return await asyncio.gather(*(one(i) for i in range(200)))

        for i, result in enumerate(asyncio.run(main())):
            expected = echoed(executor, (i,), last if i % 3 == 2 else None)
            assert result == expected, (
                f"rule broken: each await gets its own call's results (call {i} got {result})"
            )

    def test_async_calls_run_in_the_order_they_start(self, executor: Executor) -> None:
        executor.collective_rpc("clear_recorded")

        async def main() -> list[list[Any]]:
            calls = (executor.collective_rpc_async("record", args=(i,)) for i in range(30))
            return await asyncio.gather(*calls)

        assert asyncio.run(main()) == [[i + 1] * executor.world_size for i in range(30)]
        assert executor.collective_rpc("get_recorded") == [list(range(30))] * executor.world_size

    def test_execute_model_async(self, executor: Executor) -> None:
        async def main() -> list[Any]:
            return await asyncio.gather(*(executor.execute_model_async(i) for i in range(20)))

        outputs = asyncio.run(main())
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

        ticks = asyncio.run(main())
        assert ticks >= 5, f"rule broken: the event loop runs while a call is awaited ({ticks})"

    def test_async_worker_error(self, executor: Executor) -> None:
        bad = executor.world_size - 1
        call: dict[str, Any] = {"args": ("async kaboom",), "kwargs": {"on_rank": bad}}
        sync_error = executor.collective_rpc("fail", **call, non_block=True).exception(timeout=30)

        async def main() -> WorkerError:
            with pytest.raises(WorkerError) as info:
                await executor.collective_rpc_async("fail", **call)
            return info.value

        err = asyncio.run(main())
        assert (err.rank, err.method, err.exc_type) == (bad, "fail", "ValueError")
        assert "async kaboom" in err.message
        assert "in fail" in err.remote_traceback
        assert "raise ValueError" in err.remote_traceback
        assert str(err) == str(sync_error), (
            "rule broken: an awaited call's WorkerError reads as the synchronous API's"
        )
        usable_after(executor, "an awaited worker error")

    def test_async_timeout(self, executor: Executor) -> None:
        slow = self.slow_call_s / 2

        async def main() -> RPCTimeoutError:
            with pytest.raises(RPCTimeoutError) as info:
                await executor.collective_rpc_async("slow", args=(slow,), timeout=slow / 5)
            return info.value

        start = time.monotonic()
        err = asyncio.run(main())
        assert time.monotonic() - start < slow * 0.9, "rule broken: timeout fires on time"
        assert isinstance(err, TimeoutError)
        assert err.method == "slow"
        assert err.ranks, "the error must name the ranks that did not answer"
        usable_after(executor, "an awaited call's timeout")

    def test_async_cancel_keeps_ranks_in_step(self, executor: Executor) -> None:
        ws, slow = executor.world_size, 0.3
        executor.collective_rpc("clear_recorded")

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
            with pytest.raises(TimeoutError):  # an asyncio timeout is a cancellation too
                await asyncio.wait_for(
                    executor.collective_rpc_async("record_slowly", args=("timed out", 0.0)),
                    timeout=0.01,
                )
            calls = (executor.collective_rpc_async("record", args=(i,)) for i in range(10))
            return await asyncio.gather(*calls)

        results = asyncio.run(main())
        recorded = executor.collective_rpc("get_recorded")
        assert recorded[0][:1] == ["cancelled"], (
            "rule broken: a sent call runs on every rank even if its await is cancelled"
        )
        assert recorded[0][-10:] == list(range(10))
        # The call cancelled by wait_for was sent (it ran) or withdrawn, on every rank alike.
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
                asyncio.run(main(tag))
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
            assert outcome[0][:-1] == [echoed(executor, (tag, i)) for i in range(50)]
            assert outcome[0][-1]["batch"] == tag
        assert results["a"][1] is not results["b"][1]
