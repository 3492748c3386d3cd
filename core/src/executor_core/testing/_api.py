"""The executor's API, area by area: calls, futures, asyncio, errors and timeouts, sleep, the
layouts the backend declares, and the worker's device on every thread that runs a call."""

from __future__ import annotations

import asyncio
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from executor_core import (
    SLEEP_TAGS,
    Executor,
    ExecutorError,
    ExecutorFailedError,
    RPCTimeoutError,
    SleepStateError,
    WorkerError,
)

from ._base import ExecutorFactory, KitBase, check_reply_ranks, in_threads
from ._workers import DeviceProbeWorker


def _echoed(executor: Executor, args: tuple[Any, ...], rank: int | None = None) -> list[Any]:
    """What ``echo(*args)`` returns (from every rank, or only ``rank``)."""
    return [(r, args, {}) for r in (range(executor.world_size) if rank is None else [rank])]


def _usable_after(executor: Executor, what: str) -> None:
    """Fail unless the call after ``what`` gets its own results (late replies dropped)."""
    got = executor.collective_rpc("echo", args=(what,), timeout=30)
    assert got == _echoed(executor, (what,)), f"rule broken: after {what} a call got {got}"


def _timed_out(executor: Executor, call: Any, slow: float, what: str) -> None:
    """Fail unless ``call()`` (of ``slow`` s, timing out after a fifth) raises an on-time
    ``RPCTimeoutError`` naming the ranks that did not answer, and later calls work."""
    start = time.monotonic()
    try:
        error = call()
    except BaseException as exc:  # noqa: BLE001 - checked below
        error = exc
    assert isinstance(error, RPCTimeoutError), (
        f"rule broken: timeout applies to {what} too (RPCTimeoutError, not {error!r})"
    )
    assert isinstance(error, TimeoutError)
    assert error.method == "slow"
    assert error.ranks, "the error must name the ranks that did not answer"
    assert set(error.ranks) <= set(range(executor.world_size))
    assert time.monotonic() - start < slow * 0.9, "rule broken: a timeout fires on time"
    _usable_after(executor, f"the timeout of {what}")


def _gathered(*calls: Awaitable[Any]) -> list[Any]:
    """The results of ``calls``, awaited at once on a new event loop."""

    async def main() -> list[Any]:
        return await asyncio.gather(*calls)

    return asyncio.run(main())


class CallTests(KitBase):
    """Every rank runs every call; results come back in rank order."""

    def test_replies_carry_the_rank_they_came_from(self, executor: Executor) -> None:
        """Rule: a reply is delivered with the rank that ran the call, whatever order replies
        arrive in: blocking, non-blocking, and with each rank as ``unique_reply_rank``."""
        timeout, step, ranks = self.reply_probe_s(), 0.1, list(range(executor.world_size))
        rpc = executor.collective_rpc
        check_reply_ranks(executor, timeout, step)
        future = executor.collective_rpc("rank_in_reverse", timeout, (step,), non_block=True)
        got = future.result(timeout=timeout * 2)
        assert got == ranks, f"rule broken: replies carry the rank they came from: {got}"
        for rank in ranks:
            try:
                got = rpc("rank_in_reverse", timeout, (step,), unique_reply_rank=rank)
            except TimeoutError:
                got = ["none"]
            assert got == [rank], (
                f"rule broken: replies carry the rank they came from; unique_reply_rank={rank} "
                f"returns that rank's result alone, not {got}"
            )

    def test_worker_context(self, executor: Executor) -> None:
        """Rule: every worker ran ``init_device`` and ``load_model``; its ``WorkerContext``
        gives its rank and place, the backend's name, and one rendezvous for all."""
        assert executor.collective_rpc("is_ready") == [True] * executor.world_size, (
            "rule broken: every worker runs init_device and load_model before it is returned"
        )
        config, spec = executor.config, self.spec()
        contexts = executor.collective_rpc("get_context")
        tp, pp, ws = config.tensor_parallel_size, config.pipeline_parallel_size, config.world_size
        got = [
            (c.rank, c.world_size, c.tensor_parallel_size, c.pipeline_parallel_size)
            for c in contexts
        ]
        assert got == [(r, ws, tp, pp) for r in range(ws)], (
            f"rule broken: WorkerContext.rank is the worker's rank, its sizes the config's: {got}"
        )
        places = [(c.tp_rank, c.pp_rank, c.device) for c in contexts]
        assert places == [(r % tp, r // tp, config.device) for r in range(ws)], places
        names, want = [c.backend for c in contexts], spec.name if spec else contexts[0].backend
        assert set(names) == {want or None}, (
            f"rule broken: WorkerContext.backend names the backend ({want!r}), not {names}"
        )
        for n, count in Counter(c.node_id for c in contexts).items():
            local = sorted((c.local_rank, c.local_world_size) for c in contexts if c.node_id == n)
            assert local == [(r, count) for r in range(count)], (
                f"rule broken: local ranks on node {n!r} are 0..{count - 1}, one per worker, "
                f"in {count}: {local}"
            )
        methods = {ctx.distributed_init_method for ctx in contexts}
        assert len(methods) == 1, f"rule broken: one rendezvous for every rank, got {methods}"
        assert re.match(r"^(tcp://\S+:\d+|env://|file://\S+)$", methods.pop()), (
            "rule broken: distributed_init_method is a torch.distributed init method"
        )

    def test_callables_and_arguments(self, executor: Executor) -> None:
        """Rule: a call names a worker method, or passes a function or a closure; positional
        and keyword arguments arrive as given; large ones (and results) arrive whole."""
        ranks, last, big = range(executor.world_size), executor.world_size - 1, 3 << 20
        assert executor.collective_rpc(getattr, args=("rank",)) == list(ranks)  # a function
        base = {"base": 100}
        assert executor.collective_rpc(lambda w: w.rank + base["base"]) == [100 + r for r in ranks]
        results = executor.collective_rpc("echo", args=(1, "two"), kwargs={"three": [3]})
        assert results == [(r, (1, "two"), {"three": [3]}) for r in ranks]
        data = b"x" * (4 << 20)
        assert executor.collective_rpc("payload_size", args=(data,)) == [len(data)] * len(ranks)
        kwargs = {"on_rank": last}
        result = executor.collective_rpc("make_bytes", None, (big,), kwargs, unique_reply_rank=last)
        assert result == [bytes([last % 256]) * big]

    def test_unique_reply_rank(self, executor: Executor) -> None:
        """Rule: a ``unique_reply_rank`` that is not a rank is refused with ValueError naming
        it, before anything is sent; every rank runs a call whatever it says."""
        try:
            executor.collective_rpc("get_rank", unique_reply_rank=executor.world_size, timeout=5)
            pytest.fail("rule broken: a unique_reply_rank that is not a rank is refused")
        except ValueError as exc:
            assert "unique_reply_rank" in str(exc)  # noqa: PT017 - the rule's name if not
        executor.collective_rpc("get_recorded", args=(True,))
        executor.collective_rpc("record", args=("only-one-replies",), unique_reply_rank=0)
        assert executor.collective_rpc("get_recorded") == [["only-one-replies"]] * (
            executor.world_size
        ), "rule broken: every rank runs a call, whatever unique_reply_rank says"

    def test_concurrent_callers(self, executor: Executor) -> None:
        """Rule: calls from eight threads at once (blocking, and bursts of non-blocking ones)
        each get their own results and reach every rank in one order (else the ranks of a
        collective wait for ever), each thread's in the order it made them."""
        executor.collective_rpc("get_recorded", args=(True,))
        sent: dict[int, list[tuple[int, int]]] = {i: [] for i in range(8)}

        def item(index: int) -> tuple[tuple[int, int]]:
            sent[index].append((index, len(sent[index])))
            return (sent[index][-1],)

        def caller(index: int) -> None:
            jitter = random.Random(index)
            for _ in range(12):
                time.sleep(jitter.random() / 1000)
                burst = [
                    executor.collective_rpc("record", 60, item(index), non_block=True)
                    for _ in range(jitter.randint(1, 3))
                ]
                token = (index, len(sent[index]))
                got = executor.collective_rpc("echo", args=(token,), timeout=60)
                assert got == _echoed(executor, (token,)), f"rule broken: call {token} got {got}"
                executor.collective_rpc("record", 60, item(index))
                for future in burst:
                    future.result(timeout=60)

        in_threads(8, caller)
        recorded = executor.collective_rpc("get_recorded", timeout=60)
        total = sum(len(items) for items in sent.values())
        assert [len(seen) for seen in recorded] == [total] * executor.world_size, (
            "rule broken: every rank runs every call"
        )
        differ = [rank for rank, seen in enumerate(recorded) if seen != recorded[0]]
        assert not differ, (
            f"rule broken: calls from several threads reach every rank in one order; ranks "
            f"{differ} saw another order than rank 0 (send to every rank under one lock)"
        )
        for index, items in sent.items():
            assert [item for item in recorded[0] if item[0] == index] == items, (
                f"rule broken: calls from several threads reach every rank in one order, each "
                f"thread's in the order it made them (thread {index}'s are not)"
            )

    def test_execute_model_returns_output_rank(self, executor: Executor) -> None:
        config, output = executor.config, executor.output_rank
        assert output == executor.world_size - config.tensor_parallel_size
        assert executor.execute_model([1, 2, 3]) == {"rank": output, "batch": [1, 2, 3]}, (
            "rule broken: execute_model returns the output rank's result"
        )
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
        future = executor.collective_rpc("fail", args=("async boom",), non_block=True)
        with pytest.raises(WorkerError, match="async boom"):
            future.result(timeout=30)
        _usable_after(executor, "a worker error")

    def test_non_block_futures_complete_in_submission_order(self, executor: Executor) -> None:
        executor.collective_rpc("get_recorded", args=(True,))
        completed: list[Future[list[Any]]] = []
        futures = []
        for i in range(20):
            futures.append(executor.collective_rpc("record", args=(i,), non_block=True))
            futures[-1].add_done_callback(completed.append)
        results = [f.result(timeout=30) for f in futures]
        assert results == [[i + 1] * executor.world_size for i in range(20)]
        assert completed == futures, "rule broken: futures complete in submission order"
        assert executor.collective_rpc("get_recorded") == [list(range(20))] * executor.world_size

    def test_non_block_timeout(self, executor: Executor) -> None:
        slow = self.slow_call_s
        future = executor.collective_rpc("slow", slow / 5, (slow,), non_block=True)
        _timed_out(executor, lambda: future.exception(timeout=slow * 5), slow, "non_block calls")


class AsyncTests(KitBase):
    """Awaited calls get their own results and errors; a cancelled await leaves ranks in step."""

    def test_async_many_concurrent_awaits(self, executor: Executor) -> None:
        """Rule: 200 awaits at once each get their own results; awaited calls run in the
        order they start; ``execute_model_async`` returns the output rank's result."""
        last, ws, rpc = executor.world_size - 1, executor.world_size, executor.collective_rpc_async
        rank = [last if i % 3 == 2 else None for i in range(200)]
        got = _gathered(*(rpc("echo", None, (i,), None, rank[i]) for i in range(200)))
        for i, result in enumerate(got):
            assert result == _echoed(executor, (i,), rank[i]), (
                f"rule broken: each await gets its own call's results (call {i} got {result})"
            )
        executor.collective_rpc("get_recorded", args=(True,))
        results = _gathered(*(rpc("record", args=(i,)) for i in range(30)))
        assert results == [[i + 1] * ws for i in range(30)]
        assert executor.collective_rpc("get_recorded") == [list(range(30))] * ws
        outputs = _gathered(*(executor.execute_model_async(i) for i in range(20)))
        assert outputs == [{"rank": executor.output_rank, "batch": i} for i in range(20)], (
            "rule broken: execute_model_async returns the output rank's result"
        )

    def test_async_errors_are_the_synchronous_apis(self, executor: Executor) -> None:
        """Rule: an awaited call's ``WorkerError`` reads as the synchronous API's; its timeout
        fires on time with ``RPCTimeoutError``."""
        bad, slow = executor.world_size - 1, self.slow_call_s / 2
        call: dict[str, Any] = {"args": ("async kaboom",), "kwargs": {"on_rank": bad}}
        sync_error = executor.collective_rpc("fail", **call, non_block=True).exception(timeout=30)
        with pytest.raises(WorkerError) as info:
            _gathered(executor.collective_rpc_async("fail", **call))
        err = info.value
        assert (err.rank, err.method, err.exc_type) == (bad, "fail", "ValueError")
        assert "async kaboom" in err.message
        assert "raise ValueError" in err.remote_traceback
        assert str(err) == str(sync_error), (
            "rule broken: an awaited call's WorkerError reads as the synchronous API's"
        )
        rpc = executor.collective_rpc_async
        _timed_out(executor, lambda: _gathered(rpc("slow", slow / 5, (slow,))), slow, "awaits")

    def test_async_cancel_keeps_ranks_in_step(self, executor: Executor) -> None:
        ws, slow, rpc = executor.world_size, 0.3, executor.collective_rpc_async
        executor.collective_rpc("get_recorded", args=(True,))

        async def main() -> list[list[Any]]:
            loop = asyncio.get_running_loop()
            call = asyncio.ensure_future(rpc("record", None, ("cancelled", slow)))
            start = loop.time()
            await asyncio.sleep(slow / 3)  # sent: the workers are running it
            assert loop.time() - start < slow, "rule broken: the loop runs while a call waits"
            assert not call.done()
            start = loop.time()
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            assert loop.time() - start < slow / 3, "the awaiter is cancelled at once"
            with pytest.raises(TimeoutError):  # an asyncio timeout is a cancellation too
                await asyncio.wait_for(rpc("record", args=("timed out",)), timeout=0.01)
            return await asyncio.gather(*(rpc("record", None, (i,)) for i in range(10)))

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
        loops: list[asyncio.AbstractEventLoop] = []

        def run(index: int) -> None:
            async def main() -> list[Any]:
                loops.append(asyncio.get_running_loop())
                calls = [executor.collective_rpc_async("echo", args=(index, i)) for i in range(50)]
                return await asyncio.gather(*calls, executor.execute_model_async(index))

            got = asyncio.run(main())
            assert got[:-1] == [_echoed(executor, (index, i)) for i in range(50)]
            assert got[-1]["batch"] == index

        in_threads(2, run)
        assert loops[0] is not loops[1]


class ErrorTests(KitBase):
    """A worker exception raises :class:`WorkerError` with the worker's traceback."""

    def test_worker_exception_carries_rank_and_traceback(self, executor: Executor) -> None:
        """Rule: a worker's exception raises ``WorkerError`` naming the rank that raised,
        with its type, message and traceback (one that cannot be pickled too); an unknown
        method is a ``WorkerError``, a negative timeout a ``ValueError``."""
        bad = executor.world_size - 1
        with pytest.raises(WorkerError) as info:
            executor.collective_rpc("fail", args=("kaboom",), kwargs={"on_rank": bad})
        err = info.value
        assert err.rank == bad, "rule broken: a WorkerError names the rank that raised"
        assert (err.method, err.exc_type, type(err.__cause__)) == ("fail", "ValueError", ValueError)
        assert "kaboom" in err.message
        assert "in fail" in err.remote_traceback
        assert "raise ValueError" in err.remote_traceback
        assert f"rank {bad}" in str(err)
        with pytest.raises(WorkerError) as info:
            executor.collective_rpc("fail_unpicklable", args=("cannot pickle me",))
        assert "UnpicklableError" in info.value.exc_type
        assert "cannot pickle me" in info.value.message
        assert "fail_unpicklable" in info.value.remote_traceback
        with pytest.raises(WorkerError, match="no method 'no_such_method'"):
            executor.collective_rpc("no_such_method")
        with pytest.raises(ValueError, match="timeout"):
            executor.collective_rpc("get_rank", timeout=-1)
        _usable_after(executor, "worker exceptions")

    def test_lowest_failing_rank_wins(self, executor: Executor) -> None:
        with pytest.raises(WorkerError) as info:
            executor.collective_rpc("fail_later_on_lower_ranks", args=(0.2,), timeout=30)
        assert info.value.rank == 0, (
            f"rule broken: when several ranks fail, the lowest failing rank's error is raised, "
            f"not rank {info.value.rank}'s (the first to arrive: the highest rank fails first)"
        )
        _usable_after(executor, "several worker errors")

    def test_timeout(self, executor: Executor) -> None:
        slow, rpc = self.slow_call_s, executor.collective_rpc
        _timed_out(executor, lambda: rpc("slow", slow / 5, (slow,)), slow, "blocking calls")

    def test_default_timeout_from_config(self, fresh_executor: ExecutorFactory) -> None:
        executor = fresh_executor(rpc_timeout=self.slow_call_s / 5)
        with pytest.raises(RPCTimeoutError):
            executor.collective_rpc("slow", args=(self.slow_call_s,))
        got = executor.collective_rpc("slow", args=(0.0, "ok"), timeout=30)
        assert got == [(r, "ok") for r in range(executor.world_size)]

    def test_check_health(self, executor: Executor) -> None:
        executor.check_health()
        executor.collective_rpc("set_healthy", args=(False, executor.world_size - 1))
        try:
            with pytest.raises(ExecutorError):
                executor.check_health()
        finally:
            executor.collective_rpc("set_healthy", args=(True,))
        executor.check_health()

    def test_unsendable_call_fails_by_its_deadline(
        self, fresh_executor: ExecutorFactory, tmp_path: Path
    ) -> None:
        """Rule: with a rank hung, a call larger than any queue of the backend
        (``large_call_bytes``) fails by its deadline with ``RPCTimeoutError`` (or
        ``ExecutorFailedError``, half-sent; ``shutdown()`` is then prompt, the rank still hung)."""
        executor, release = fresh_executor(), tmp_path / "release"
        self.hold_last_rank(executor, release)
        time.sleep(self.slow_call_s / 5)  # the rank is in the call
        data, timeout = bytes(self.large_call_bytes), self.slow_call_s / 2
        outcome: Future[Any] = Future()

        def call() -> None:
            try:
                outcome.set_result(executor.collective_rpc("payload_size", timeout, (data,)))
            except BaseException as exc:  # noqa: BLE001 - checked in the test's thread
                outcome.set_exception(exc)

        threading.Thread(target=call, name="conformance-large-call", daemon=True).start()
        try:
            error = outcome.exception(timeout + self.slow_call_s)
        except TimeoutError:
            # Unstick the send (fail() interrupts the transport) so that the test ends now.
            executor.fail(ExecutorFailedError("conformance kit: a send ran past its deadline"))
            pytest.fail(
                f"rule broken: with a rank hung, a call that cannot be sent fails by its "
                f"deadline ({timeout:g} s; Transport.send returns False once it passed)"
            )
        assert isinstance(error, RPCTimeoutError | ExecutorFailedError), (
            f"rule broken: with a rank hung, a call that cannot be sent fails by its deadline "
            f"with RPCTimeoutError (or ExecutorFailedError), not {error!r}"
        )
        if not executor.is_failed:  # shutdown with a rank hung, graceful: LifecycleTests'
            release.touch()
        self.assert_prompt_shutdown(executor, "with a rank hung", release)


class SleepTests(KitBase):
    """``sleep`` and ``wake_up`` reach every worker and keep the tags right."""

    def test_sleep_and_wake_up(self, executor: Executor) -> None:
        ws = executor.world_size
        with pytest.raises(SleepStateError, match="level"):
            executor.sleep(level=3)
        with pytest.raises(SleepStateError, match="unknown sleep tags"):
            executor.wake_up(["gpu"])
        with pytest.raises(SleepStateError, match="not asleep"):
            executor.wake_up(["kv_cache"])
        executor.wake_up()  # nothing asleep: a no-op
        assert executor.sleeping_tags == frozenset()
        executor.sleep(level=1)
        assert executor.is_sleeping
        assert executor.sleeping_tags == frozenset(SLEEP_TAGS)
        assert executor.collective_rpc("sleep_state") == [sorted(SLEEP_TAGS)] * ws
        executor.wake_up(["weights"])
        assert executor.sleeping_tags == frozenset({"kv_cache"})
        assert executor.collective_rpc("sleep_state") == [["kv_cache"]] * ws
        with pytest.raises(SleepStateError, match="not asleep"):
            executor.wake_up(["weights"])
        executor.wake_up()
        assert executor.sleeping_tags == frozenset()
        assert executor.is_sleeping == bool(executor.sleeping_tags)
        assert executor.collective_rpc("sleep_state") == [[]] * ws


class PipelineTests(KitBase):
    """A backend that declares pipeline parallelism runs it; one that does not refuses it."""

    def test_pipeline_parallel_as_declared(self, fresh_executor: ExecutorFactory) -> None:
        spec = self.spec()
        if spec is None:
            pytest.skip("an unregistered executor class declares no capabilities")
        if not spec.capabilities.pipeline_parallel:
            with pytest.raises(ExecutorError, match="pipeline"):
                fresh_executor(pipeline_parallel_size=2, world_size=2)
            return
        executor = fresh_executor(pipeline_parallel_size=2, world_size=2)
        assert (executor.output_rank, executor.max_concurrent_batches) == (1, 2)
        futures = [executor.execute_model(i, non_block=True) for i in range(4)]
        assert [f.result(timeout=30) for f in futures] == [
            {"rank": 1, "batch": i} for i in range(4)
        ], "rule broken: a pipeline's steps complete in order, from the last stage's rank"

    def test_world_size_limit_as_declared(self, fresh_executor: ExecutorFactory) -> None:
        spec = self.spec()
        limit = spec.capabilities.max_world_size if spec else None
        if limit is None:
            pytest.skip("the backend declares no limit")
        with pytest.raises(ExecutorError, match="at most"):
            fresh_executor(world_size=limit + 1)


def _assert_devices(probes: list[Any], how: str) -> None:
    wrong = [
        f"rank {rank} on thread {thread!r} saw device {seen}, not {expected}"
        for rank, (thread, seen, expected) in enumerate(probes)
        if seen != expected
    ]
    assert not wrong, f"rule broken: the worker's device is current in {how}: {'; '.join(wrong)}"


class DeviceTests(KitBase):
    """The device a worker made current in ``init_device`` is current in every call."""

    @pytest.fixture(scope="class")
    @classmethod
    def probed(cls, executor_factory: ExecutorFactory) -> Iterator[Executor]:
        """One executor of :class:`DeviceProbeWorker` for the class's device tests."""
        pytest.importorskip("torch", reason="the device probe stands in for torch.cuda")
        yield from cls._shared(executor_factory, worker_cls=DeviceProbeWorker)

    def test_device_is_current_in_every_kind_of_call(self, probed: Executor) -> None:
        """Rule: blocking calls, calls with a timeout, non-blocking calls and
        ``execute_model`` (blocking and not) run with the worker's device current."""
        _assert_devices(probed.collective_rpc("probe"), "a blocking call")
        _assert_devices(probed.collective_rpc("probe", timeout=30.0), "a call with a timeout")
        future = probed.collective_rpc("probe", non_block=True)
        _assert_devices(future.result(timeout=30.0), "a non-blocking call")
        _assert_devices([probed.execute_model(None)], "execute_model")
        future = probed.execute_model(None, non_block=True)
        _assert_devices([future.result(timeout=30.0)], "execute_model(non_block=True)")

    def test_device_is_current_in_calls_from_other_driver_threads(self, probed: Executor) -> None:
        in_threads(2, lambda _: _assert_devices(probed.collective_rpc("probe"), "another thread"))
