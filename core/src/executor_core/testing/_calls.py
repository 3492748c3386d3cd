"""Calls: results and their ranks, arguments, order, worker contexts (:class:`CallTests`);
futures (:class:`NonBlockingTests`); worker errors, timeouts and health (:class:`ErrorTests`)."""

from __future__ import annotations

import random
import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from executor_core import Executor, ExecutorError, ExecutorFailedError, RPCTimeoutError, WorkerError

from ._base import ExecutorFactory, KitBase, check_reply_ranks
from ._workers import ConformanceWorker

__all__ = ["CallTests", "ErrorTests", "NonBlockingTests", "echoed", "usable_after"]


def echoed(executor: Executor, args: tuple[Any, ...], rank: int | None = None) -> list[Any]:
    """What ``echo(*args)`` returns (from every rank, or only ``rank``)."""
    ranks = range(executor.world_size) if rank is None else [rank]
    return [(r, args, {}) for r in ranks]


def usable_after(executor: Executor, what: str) -> None:
    """Fail unless the next call after ``what`` gets its own results (late replies dropped)."""
    assert executor.collective_rpc("echo", args=(what,), timeout=30) == echoed(executor, (what,)), (
        f"rule broken: after {what} the executor stays usable and the next call gets its own "
        "results, not late ones"
    )


def _square_plus(worker: ConformanceWorker, offset: int) -> int:
    return worker.rank * worker.rank + offset


def _in_threads(count: int, target: Callable[[int], None]) -> None:
    """Run ``target(i)`` on ``count`` threads at once; fail if one hangs or raises."""
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            target(index)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a caller thread hung"
    if errors:
        raise errors[0]


class CallTests(KitBase):
    """Every rank runs every call; results come back in rank order."""

    def test_replies_carry_the_rank_they_came_from(self, executor: Executor) -> None:
        """Rule: each reply is delivered with the rank that ran the call, whatever order the
        replies arrive in (here the highest rank answers first), on every path: a blocking
        call, a non-blocking one, and each rank as ``unique_reply_rank`` (that rank's result
        alone); a mislabelled reply fails within seconds, not as a hang."""
        timeout, step = self.reply_probe_s(), 0.1
        check_reply_ranks(executor, timeout, step)
        future = executor.collective_rpc(
            "rank_in_reverse", args=(step,), timeout=timeout, non_block=True
        )
        assert future.result(timeout=timeout * 2) == list(range(executor.world_size)), (
            "rule broken: replies carry the rank they came from (a non-blocking call's "
            "results are out of place)"
        )
        for rank in range(executor.world_size):
            try:
                got = executor.collective_rpc(
                    "rank_in_reverse", args=(step,), timeout=timeout, unique_reply_rank=rank
                )
            except TimeoutError:
                pytest.fail(
                    f"rule broken: replies carry the rank they came from; with "
                    f"unique_reply_rank={rank}, rank {rank}'s reply never arrived as its own"
                )
            assert got == [rank], (
                f"rule broken: replies carry the rank they came from; unique_reply_rank="
                f"{rank} returns that rank's result alone, not {got}"
            )

    def test_workers_were_initialised_and_loaded(self, executor: Executor) -> None:
        assert executor.collective_rpc("is_ready") == [True] * executor.world_size, (
            "rule broken: every worker runs init_device and load_model before the executor "
            "is returned"
        )

    def test_worker_context(self, executor: Executor) -> None:
        contexts = executor.collective_rpc("get_context")
        config, spec = executor.config, self.spec()
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
                    f"backend's name {spec.name!r}"
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

    def test_callables_and_arguments(self, executor: Executor) -> None:
        """Rule: a call may name a worker method, or pass a function or a closure; positional
        and keyword arguments arrive as given."""
        ranks = range(executor.world_size)
        assert executor.collective_rpc(_square_plus, args=(3,)) == [r * r + 3 for r in ranks]
        captured = {"base": 100}
        assert executor.collective_rpc(lambda w: w.rank + captured["base"]) == [
            100 + r for r in ranks
        ]
        results = executor.collective_rpc("echo", args=(1, "two"), kwargs={"three": [3]})
        assert results == [(r, (1, "two"), {"three": [3]}) for r in ranks]

    def test_large_argument_and_result(self, executor: Executor) -> None:
        data = b"x" * (4 << 20)
        ws, last = executor.world_size, executor.world_size - 1
        assert executor.collective_rpc("payload_size", args=(data,)) == [len(data)] * ws
        result = executor.collective_rpc(
            "make_bytes", args=(3 << 20,), kwargs={"on_rank": last}, unique_reply_rank=last
        )
        assert result == [bytes([last % 256]) * (3 << 20)]

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
        assert executor.collective_rpc("get_recorded") == [["only-one-replies"]] * (
            executor.world_size
        ), "rule broken: every rank runs a call, whatever unique_reply_rank says"

    def test_concurrent_callers_get_their_own_results(self, executor: Executor) -> None:
        def caller(index: int) -> None:
            for call in range(15):
                token = f"t{index}-c{call}"
                result = executor.collective_rpc("echo", args=(token,), timeout=60)
                assert result == echoed(executor, (token,)), (
                    f"rule broken: each caller gets its own call's results ({token}: {result})"
                )

        _in_threads(8, caller)

    def test_concurrent_callers_reach_every_rank_in_the_same_order(
        self, executor: Executor
    ) -> None:
        """Rule: calls from several threads reach every rank in one and the same order
        (ranks that saw calls in different orders would wait on each other for ever in a
        collective), each thread's in the order it made them. Eight threads call at once,
        blocking and in bursts of non-blocking calls, with random pauses of up to a
        millisecond, so that sends to the ranks one after the other without one lock
        around all of them interleave."""
        executor.collective_rpc("clear_recorded")
        sent: dict[int, list[tuple[int, int]]] = {i: [] for i in range(8)}

        def item(index: int) -> tuple[tuple[int, int]]:
            sent[index].append((index, len(sent[index])))
            return (sent[index][-1],)

        def caller(index: int) -> None:
            jitter = random.Random(index)
            for _ in range(12):
                time.sleep(jitter.random() / 1000)
                burst = [
                    executor.collective_rpc("record", args=item(index), timeout=60, non_block=True)
                    for _ in range(jitter.randint(1, 3))
                ]
                executor.collective_rpc("record", args=item(index), timeout=60)
                for future in burst:
                    future.result(timeout=60)

        _in_threads(8, caller)
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
        config = executor.config
        assert executor.output_rank == executor.world_size - config.tensor_parallel_size
        assert executor.execute_model([1, 2, 3]) == {
            "rank": executor.output_rank,
            "batch": [1, 2, 3],
        }, "rule broken: execute_model returns the output rank's result"
        assert executor.max_concurrent_batches >= 1
        if config.pipeline_parallel_size > 1:
            assert executor.max_concurrent_batches == config.pipeline_parallel_size


class NonBlockingTests(KitBase):
    """``non_block=True`` returns a future; futures complete in submission order."""

    def test_non_block_returns_future(self, executor: Executor) -> None:
        future = executor.collective_rpc("get_rank", non_block=True)
        assert isinstance(future, Future)
        assert future.result(timeout=30) == list(range(executor.world_size))
        futures = [executor.execute_model(i, non_block=True) for i in range(5)]
        assert [f.result(timeout=30)["batch"] for f in futures] == list(range(5))

    def test_non_block_futures_complete_in_submission_order(self, executor: Executor) -> None:
        executor.collective_rpc("clear_recorded")
        completed: list[Future[list[Any]]] = []
        futures = []
        for i in range(20):
            futures.append(executor.collective_rpc("record", args=(i,), non_block=True))
            futures[-1].add_done_callback(completed.append)
        results = [f.result(timeout=30) for f in futures]
        assert results == [[i + 1] * executor.world_size for i in range(20)]
        assert completed == futures, "rule broken: futures complete in submission order"
        assert executor.collective_rpc("get_recorded") == [list(range(20))] * executor.world_size

    def test_non_block_worker_error(self, executor: Executor) -> None:
        future = executor.collective_rpc("fail", args=("async boom",), non_block=True)
        with pytest.raises(WorkerError, match="async boom"):
            future.result(timeout=30)
        usable_after(executor, "a worker error")

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
        usable_after(executor, "a timeout")


class ErrorTests(KitBase):
    """A worker exception raises :class:`WorkerError` with the worker's traceback."""

    def test_worker_exception_carries_rank_and_traceback(self, executor: Executor) -> None:
        bad = executor.world_size - 1
        with pytest.raises(WorkerError) as info:
            executor.collective_rpc("fail", args=("kaboom",), kwargs={"on_rank": bad})
        err = info.value
        assert err.rank == bad, "rule broken: a WorkerError names the rank that raised"
        assert (err.method, err.exc_type) == ("fail", "ValueError")
        assert "kaboom" in err.message
        assert "in fail" in err.remote_traceback
        assert "raise ValueError" in err.remote_traceback
        assert isinstance(err.__cause__, ValueError)
        assert f"rank {bad}" in str(err)
        usable_after(executor, "a worker exception")

    def test_lowest_failing_rank_wins(self, executor: Executor) -> None:
        # The highest rank fails first; the error raised must still be the lowest rank's.
        with pytest.raises(WorkerError) as info:
            executor.collective_rpc("fail_later_on_lower_ranks", args=(0.2,), timeout=30)
        assert info.value.rank == 0, (
            f"rule broken: when several ranks fail, the lowest failing rank's error is raised "
            f"(got rank {info.value.rank}'s, the first to arrive)"
        )
        usable_after(executor, "several worker errors")

    def test_unpicklable_worker_exception(self, executor: Executor) -> None:
        with pytest.raises(WorkerError) as info:
            executor.collective_rpc("fail_unpicklable", args=("cannot pickle me",))
        assert "UnpicklableError" in info.value.exc_type
        assert "cannot pickle me" in info.value.message
        assert "fail_unpicklable" in info.value.remote_traceback
        usable_after(executor, "an unpicklable exception")

    def test_unknown_method_and_invalid_timeout(self, executor: Executor) -> None:
        with pytest.raises(WorkerError, match="no method 'no_such_method'"):
            executor.collective_rpc("no_such_method")
        with pytest.raises(ValueError, match="timeout"):
            executor.collective_rpc("get_rank", timeout=-1)

    def test_timeout(self, executor: Executor) -> None:
        start = time.monotonic()
        with pytest.raises(RPCTimeoutError) as info:
            executor.collective_rpc("slow", args=(self.slow_call_s,), timeout=self.slow_call_s / 5)
        assert isinstance(info.value, TimeoutError)
        assert info.value.method == "slow"
        assert info.value.ranks, "the error must name the ranks that did not answer"
        assert set(info.value.ranks) <= set(range(executor.world_size))
        assert time.monotonic() - start < self.slow_call_s * 0.9, "rule broken: timeout on time"
        usable_after(executor, "a timeout")

    def test_default_timeout_from_config(self, fresh_executor: ExecutorFactory) -> None:
        executor = fresh_executor(rpc_timeout=self.slow_call_s / 5)
        with pytest.raises(RPCTimeoutError):
            executor.collective_rpc("slow", args=(self.slow_call_s,))
        assert executor.collective_rpc("slow", args=(0.0, "ok"), timeout=30) == [
            (r, "ok") for r in range(executor.world_size)
        ]

    def test_check_health(self, executor: Executor) -> None:
        executor.check_health()
        bad = executor.world_size - 1
        executor.collective_rpc("set_healthy", args=(False,), kwargs={"on_rank": bad})
        try:
            with pytest.raises(ExecutorError):
                executor.check_health()
        finally:
            executor.collective_rpc("set_healthy", args=(True,))
        executor.check_health()

    def test_unsendable_call_fails_by_its_deadline(
        self, fresh_executor: ExecutorFactory, tmp_path: Path
    ) -> None:
        """Rule: with a rank hung in a call, a call that cannot be sent (``large_call_bytes``,
        more than any queue or ring of the backend holds) still fails by its deadline
        (``Transport.send`` returns False once ``call.deadline`` passed), with
        :class:`RPCTimeoutError`, or :class:`ExecutorFailedError` where a half-sent call
        puts the backend's queues out of step; ``shutdown()`` then returns within
        ``shutdown_s``, the rank still hung."""
        executor = fresh_executor()
        release = tmp_path / "release"
        hold = (str(release), executor.world_size - 1, self.time_limit_s)
        executor.collective_rpc("hold", args=hold, non_block=True)
        time.sleep(self.slow_call_s / 5)  # the rank is in the call
        data, timeout = bytes(self.large_call_bytes), self.slow_call_s / 2
        outcome: list[BaseException | None] = []

        def call() -> None:
            try:
                executor.collective_rpc("payload_size", args=(data,), timeout=timeout)
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - checked in the test's thread
                outcome.append(exc)

        caller = threading.Thread(target=call, name="conformance-large-call", daemon=True)
        start = time.monotonic()
        caller.start()
        caller.join(timeout + self.slow_call_s)
        if caller.is_alive():
            took = time.monotonic() - start
            # Unstick the send (fail() interrupts the transport) so that the test ends now.
            executor.fail(ExecutorFailedError("conformance kit: a send ran past its deadline"))
            release.touch()
            caller.join(self.settle_s)
            pytest.fail(
                f"rule broken: with a rank hung, a call that cannot be sent fails by its "
                f"deadline ({timeout:g} s); it still waited after {took:.1f} s (Transport.send "
                "must return False once call.deadline passed)"
            )
        assert isinstance(outcome[0], RPCTimeoutError | ExecutorFailedError), (
            f"rule broken: with a rank hung, a call that cannot be sent fails by its deadline "
            f"with RPCTimeoutError (or ExecutorFailedError), not {outcome[0]!r}"
        )
        self.assert_prompt_shutdown(executor, "with a rank hung", release)
