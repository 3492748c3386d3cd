"""Conformance kit, calls: results, arguments, reply ranks, ordering, worker contexts."""

from __future__ import annotations

import random
import re
import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from typing import Any

import pytest

from .._executor import Executor
from ._base import KitBase, check_reply_ranks
from ._workers import ConformanceWorker

__all__ = ["CallTests"]


def _square_plus(worker: ConformanceWorker, offset: int) -> int:
    return worker.rank * worker.rank + offset


class CallTests(KitBase):
    """Every rank runs every call; results come back in rank order."""

    def test_replies_carry_the_rank_they_came_from(self, executor: Executor) -> None:
        """Rule: each reply is delivered with the rank that ran the call, on every path (a
        blocking call, a non-blocking one, and each rank as ``unique_reply_rank``); a
        mislabelled reply fails here, within seconds, instead of hanging a later call."""
        timeout = self.reply_probe_s()
        check_reply_ranks(executor, timeout)
        future = executor.collective_rpc("get_rank", timeout=timeout, non_block=True)
        assert future.result(timeout=timeout * 2) == list(range(executor.world_size)), (
            "rule broken: replies carry the rank they came from (a non-blocking call's "
            "results are out of place)"
        )
        for rank in range(executor.world_size):
            try:
                got = executor.collective_rpc("get_rank", timeout=timeout, unique_reply_rank=rank)
            except TimeoutError:
                pytest.fail(
                    f"rule broken: replies carry the rank they came from; with "
                    f"unique_reply_rank={rank}, rank {rank}'s reply never arrived as its own "
                    f"within {timeout:g} s"
                )
            assert got == [rank], (
                f"rule broken: replies carry the rank they came from; with "
                f"unique_reply_rank={rank} the reply came from rank {got}"
            )

    def test_results_in_rank_order(self, executor: Executor) -> None:
        assert executor.collective_rpc("get_rank") == list(range(executor.world_size)), (
            "rule broken: results come back in rank order, one per rank"
        )

    def test_workers_were_initialised_and_loaded(self, executor: Executor) -> None:
        assert executor.collective_rpc("is_ready") == [True] * executor.world_size, (
            "rule broken: every worker runs init_device and load_model before the executor "
            "is returned"
        )

    def test_worker_context(self, executor: Executor) -> None:
        contexts = executor.collective_rpc("get_context")
        config = executor.config
        spec = self.spec()
        for rank, ctx in enumerate(contexts):
            assert ctx.rank == rank, "rule broken: WorkerContext.rank is the worker's rank"
            assert ctx.world_size == config.world_size
            assert ctx.tensor_parallel_size == config.tensor_parallel_size
            assert ctx.pipeline_parallel_size == config.pipeline_parallel_size
            assert ctx.tp_rank == rank % config.tensor_parallel_size
            assert ctx.pp_rank == rank // config.tensor_parallel_size
            assert ctx.device == config.device
            assert ctx.backend, "rule broken: WorkerContext.backend names the backend"
            if spec is not None:
                assert ctx.backend == spec.name, (
                    f"rule broken: WorkerContext.backend is {ctx.backend!r}, not the "
                    f"backend's name {spec.name!r} (build contexts with TransportHost.context)"
                )
        by_node: dict[str, list[Any]] = defaultdict(list)
        for ctx in contexts:
            by_node[ctx.node_id].append(ctx)
        for node, ranks in by_node.items():
            assert sorted(c.local_rank for c in ranks) == list(range(len(ranks))), (
                f"rule broken: local ranks on node {node!r} must be 0..{len(ranks) - 1}, one "
                f"per worker, got {[c.local_rank for c in ranks]}"
            )
            assert all(c.local_world_size == len(ranks) for c in ranks), (
                f"rule broken: local_world_size on node {node!r} must be {len(ranks)}"
            )
        methods = {ctx.distributed_init_method for ctx in contexts}
        assert len(methods) == 1, f"rule broken: one rendezvous for every rank, got {methods}"
        assert re.match(r"^(tcp://\S+:\d+|env://|file://\S+)$", methods.pop()), (
            "rule broken: distributed_init_method is a torch.distributed init method"
        )

    def test_callable_method(self, executor: Executor) -> None:
        results = executor.collective_rpc(_square_plus, args=(3,))
        assert results == [r * r + 3 for r in range(executor.world_size)]

    def test_lambda_with_closure(self, executor: Executor) -> None:
        captured = {"base": 100}
        results = executor.collective_rpc(lambda w: w.rank + captured["base"])
        assert results == [100 + r for r in range(executor.world_size)]

    def test_args_and_kwargs(self, executor: Executor) -> None:
        results = executor.collective_rpc("echo", args=(1, "two"), kwargs={"three": [3]})
        assert results == [(r, (1, "two"), {"three": [3]}) for r in range(executor.world_size)]

    def test_large_argument_and_result(self, executor: Executor) -> None:
        data = b"x" * (4 << 20)
        assert executor.collective_rpc("payload_size", args=(data,)) == [len(data)] * (
            executor.world_size
        )
        last = executor.world_size - 1
        result = executor.collective_rpc(
            "make_bytes", args=(3 << 20,), kwargs={"on_rank": last}, unique_reply_rank=last
        )
        assert result == [bytes([last % 256]) * (3 << 20)]

    def test_unique_reply_rank(self, executor: Executor) -> None:
        for rank in range(executor.world_size):
            assert executor.collective_rpc("get_rank", unique_reply_rank=rank) == [rank], (
                "rule broken: unique_reply_rank returns that rank's result alone"
            )

    def test_unique_reply_rank_out_of_range(self, executor: Executor) -> None:
        try:
            executor.collective_rpc("get_rank", unique_reply_rank=executor.world_size, timeout=5)
        except ValueError as exc:
            # A message that names the argument, not the pytest.raises failure text.
            assert "unique_reply_rank" in str(exc)  # noqa: PT017 - see above
        else:
            pytest.fail(
                "rule broken: a unique_reply_rank that is not a rank is refused with ValueError "
                "before anything is sent"
            )

    def test_all_ranks_run_with_unique_reply_rank(self, executor: Executor) -> None:
        executor.collective_rpc("clear_recorded")
        executor.collective_rpc("record", args=("only-one-replies",), unique_reply_rank=0)
        recorded = executor.collective_rpc("get_recorded")
        assert recorded == [["only-one-replies"]] * executor.world_size, (
            "rule broken: every rank runs a call, whatever unique_reply_rank says"
        )

    def test_concurrent_callers_get_their_own_results(self, executor: Executor) -> None:
        ws = executor.world_size
        errors: list[BaseException] = []

        def caller(thread_index: int) -> None:
            try:
                for call in range(15):
                    token = f"t{thread_index}-c{call}"
                    result = executor.collective_rpc("echo", args=(token,), timeout=60)
                    assert result == [(r, (token,), {}) for r in range(ws)]
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread below
                errors.append(exc)

        threads = [threading.Thread(target=caller, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a caller thread hung"
        assert not errors, errors[0]

    def test_concurrent_callers_reach_every_rank_in_the_same_order(
        self, executor: Executor
    ) -> None:
        """Rule: calls from several threads reach every rank in one and the same order
        (worker methods may run collectives: ranks that saw calls in different orders would
        wait on each other for ever), and each thread's calls in the order it made them.

        Eight threads call at once, blocking and in bursts of non-blocking calls, with random
        pauses of up to a millisecond between calls, so that a send that reaches the ranks
        one after the other without one lock around all of them is interleaved."""
        executor.collective_rpc("clear_recorded")
        threads_n, rounds = 8, 12
        errors: list[BaseException] = []
        sent: dict[int, list[tuple[int, int]]] = {i: [] for i in range(threads_n)}

        def caller(thread_index: int) -> None:
            jitter = random.Random(thread_index)
            try:
                call = 0
                for _ in range(rounds):
                    time.sleep(jitter.random() / 1000)
                    burst: list[Future[list[Any]]] = []
                    for _ in range(jitter.randint(1, 3)):
                        item = (thread_index, call)
                        sent[thread_index].append(item)
                        call += 1
                        burst.append(
                            executor.collective_rpc(
                                "record", args=(item,), timeout=60, non_block=True
                            )
                        )
                    item = (thread_index, call)
                    sent[thread_index].append(item)
                    call += 1
                    executor.collective_rpc("record", args=(item,), timeout=60)
                    for future in burst:
                        future.result(timeout=60)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread below
                errors.append(exc)

        threads = [threading.Thread(target=caller, args=(i,)) for i in range(threads_n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a caller thread hung"
        assert not errors, errors[0]
        recorded = executor.collective_rpc("get_recorded", timeout=60)
        total = sum(len(items) for items in sent.values())
        assert [len(seen) for seen in recorded] == [total] * executor.world_size, (
            "rule broken: every rank runs every call"
        )
        differ = [rank for rank, seen in enumerate(recorded) if seen != recorded[0]]
        assert not differ, (
            f"rule broken: calls from several threads reach every rank in one order; ranks "
            f"{differ} saw them in another order than rank 0 (send a call to every rank under "
            "one lock, or from one thread, before the next call)"
        )
        for index, items in sent.items():
            assert [item for item in recorded[0] if item[0] == index] == items, (
                f"rule broken: calls from several threads reach every rank in one order, each "
                f"thread's in the order it made them (thread {index}'s are out of order)"
            )

    def test_execute_model_returns_output_rank(self, executor: Executor) -> None:
        assert executor.output_rank == executor.world_size - executor.config.tensor_parallel_size
        assert executor.execute_model([1, 2, 3]) == {
            "rank": executor.output_rank,
            "batch": [1, 2, 3],
        }, "rule broken: execute_model returns the output rank's result"

    def test_max_concurrent_batches(self, executor: Executor) -> None:
        assert executor.max_concurrent_batches >= 1
        if executor.config.pipeline_parallel_size > 1:
            assert executor.max_concurrent_batches == executor.config.pipeline_parallel_size
