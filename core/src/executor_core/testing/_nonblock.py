"""Conformance kit, non-blocking calls: futures, their order, their errors and timeouts."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest

from .._errors import RPCTimeoutError, WorkerError
from .._executor import Executor
from ._base import KitBase

__all__ = ["NonBlockingTests"]


class NonBlockingTests(KitBase):
    """``non_block=True`` returns a future; futures complete in submission order."""

    def test_non_block_returns_future(self, executor: Executor) -> None:
        future = executor.collective_rpc("get_rank", non_block=True)
        assert isinstance(future, Future)
        assert future.result(timeout=30) == list(range(executor.world_size))

    def test_non_block_futures_complete_in_submission_order(self, executor: Executor) -> None:
        executor.collective_rpc("clear_recorded")
        completed: list[int] = []
        lock = threading.Lock()

        def on_done(index: int) -> Callable[[Future[list[Any]]], None]:
            def callback(_fut: Future[list[Any]]) -> None:
                with lock:
                    completed.append(index)

            return callback

        futures = []
        for i in range(20):
            fut = executor.collective_rpc("record", args=(i,), non_block=True)
            fut.add_done_callback(on_done(i))
            futures.append(fut)
        results = [f.result(timeout=30) for f in futures]
        assert results == [[i + 1] * executor.world_size for i in range(20)]
        assert completed == list(range(20)), "rule broken: futures complete in submission order"
        assert executor.collective_rpc("get_recorded") == [list(range(20))] * executor.world_size

    def test_non_block_worker_error(self, executor: Executor) -> None:
        future = executor.collective_rpc("fail", args=("async boom",), non_block=True)
        with pytest.raises(WorkerError, match="async boom"):
            future.result(timeout=30)
        assert executor.collective_rpc("get_rank") == list(range(executor.world_size))

    def test_non_block_timeout(self, executor: Executor) -> None:
        slow = self.slow_call_s
        start = time.monotonic()
        future = executor.collective_rpc("slow", args=(slow,), timeout=slow / 5, non_block=True)
        try:
            future.result(timeout=slow * 5)
        except RPCTimeoutError as exc:
            # Not pytest.raises: a missing timeout must fail with the rule's name.
            assert exc.ranks, "the error must name the ranks that did not answer"  # noqa: PT017
        else:
            pytest.fail("rule broken: timeout applies to non_block calls too (RPCTimeoutError)")
        assert time.monotonic() - start < slow * 0.9, (
            "rule broken: a non_block call's timeout fires on time, not when the call ends"
        )
        assert executor.collective_rpc("echo", args=("after",)) == [
            (r, ("after",), {}) for r in range(executor.world_size)
        ], "rule broken: the executor stays usable after a timeout (late replies dropped)"

    def test_execute_model_non_block(self, executor: Executor) -> None:
        futures = [executor.execute_model(i, non_block=True) for i in range(5)]
        assert [f.result(timeout=30)["batch"] for f in futures] == list(range(5))
