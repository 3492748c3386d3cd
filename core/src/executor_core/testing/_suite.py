"""The Executor conformance suite. A backend's test module subclasses it and gives one fixture.

Example::

    from executor_core.testing import ExecutorConformanceTests, conformance_config

    class TestMyBackend(ExecutorConformanceTests):
        @pytest.fixture(scope="class")
        @classmethod
        def executor_factory(cls):
            def make(**overrides):
                return create_executor(conformance_config("my-backend", world_size=2, **overrides))
            return make
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest

from .._config import ExecutorConfig
from .._errors import (
    ExecutorClosedError,
    ExecutorError,
    ExecutorFailedError,
    RPCTimeoutError,
    SleepStateError,
    WorkerError,
)
from .._executor import Executor
from .._worker import SLEEP_TAGS
from ._workers import ConformanceWorker

__all__ = ["ExecutorConformanceTests", "ExecutorFactory", "conformance_config"]

#: Builds a started executor; keyword arguments override ExecutorConfig fields.
ExecutorFactory = Callable[..., Executor]


def conformance_config(backend: str | type, **overrides: Any) -> ExecutorConfig:
    """An ExecutorConfig that runs :class:`ConformanceWorker` on ``backend``.

    ``world_size=N`` is accepted as a shorthand for ``tensor_parallel_size=N``.
    """
    world_size = overrides.pop("world_size", None)
    if world_size is not None and "tensor_parallel_size" not in overrides:
        overrides["tensor_parallel_size"] = world_size // overrides.get("pipeline_parallel_size", 1)
    overrides.setdefault("worker_cls", ConformanceWorker)
    return ExecutorConfig(backend=backend, **overrides)


def _square_plus(worker: ConformanceWorker, offset: int) -> int:
    return worker.rank * worker.rank + offset


class ExecutorConformanceTests:
    """Tests of the Executor contract. Subclass and override :meth:`executor_factory`."""

    #: Seconds a slow call sleeps in the timeout tests; the timeout is a fraction of it.
    slow_call_s: float = 1.0

    @pytest.fixture(scope="class")
    @classmethod
    def executor_factory(cls) -> ExecutorFactory:
        """Override: return ``make(**config_overrides) -> Executor`` for your backend."""
        raise NotImplementedError("subclasses must override the executor_factory fixture")

    @pytest.fixture(scope="class")
    @classmethod
    def executor(cls, executor_factory: ExecutorFactory) -> Iterator[Executor]:
        """One executor shared by the non-destructive tests of the class."""
        executor = executor_factory()
        try:
            yield executor
        finally:
            executor.shutdown()

    @pytest.fixture
    def fresh_executor(self, executor_factory: ExecutorFactory) -> Iterator[ExecutorFactory]:
        """A factory for executors a test may break or shut down; all are shut down after."""
        made: list[Executor] = []

        def make(**overrides: Any) -> Executor:
            executor = executor_factory(**overrides)
            made.append(executor)
            return executor

        try:
            yield make
        finally:
            for executor in made:
                executor.shutdown()

    # --- calls and results -----------------------------------------------------------------

    def test_results_in_rank_order(self, executor: Executor) -> None:
        assert executor.collective_rpc("get_rank") == list(range(executor.world_size))

    def test_workers_were_initialised_and_loaded(self, executor: Executor) -> None:
        assert executor.collective_rpc("is_ready") == [True] * executor.world_size

    def test_worker_context(self, executor: Executor) -> None:
        contexts = executor.collective_rpc("get_context")
        config = executor.config
        for rank, ctx in enumerate(contexts):
            assert ctx.rank == rank
            assert ctx.world_size == config.world_size
            assert ctx.tensor_parallel_size == config.tensor_parallel_size
            assert ctx.pipeline_parallel_size == config.pipeline_parallel_size
            assert ctx.tp_rank == rank % config.tensor_parallel_size
            assert ctx.pp_rank == rank // config.tensor_parallel_size
            assert ctx.distributed_init_method
            assert 0 <= ctx.local_rank < max(ctx.local_world_size, 1)

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
            assert executor.collective_rpc("get_rank", unique_reply_rank=rank) == [rank]

    def test_unique_reply_rank_out_of_range(self, executor: Executor) -> None:
        with pytest.raises(ValueError, match="unique_reply_rank"):
            executor.collective_rpc("get_rank", unique_reply_rank=executor.world_size)

    def test_all_ranks_run_with_unique_reply_rank(self, executor: Executor) -> None:
        executor.collective_rpc("clear_recorded")
        executor.collective_rpc("record", args=("only-one-replies",), unique_reply_rank=0)
        recorded = executor.collective_rpc("get_recorded")
        assert recorded == [["only-one-replies"]] * executor.world_size

    # --- non-blocking ------------------------------------------------------------------------

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
        assert completed == list(range(20))
        assert executor.collective_rpc("get_recorded") == [list(range(20))] * executor.world_size

    def test_non_block_worker_error(self, executor: Executor) -> None:
        future = executor.collective_rpc("fail", args=("async boom",), non_block=True)
        with pytest.raises(WorkerError, match="async boom"):
            future.result(timeout=30)
        assert executor.collective_rpc("get_rank") == list(range(executor.world_size))

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
        # Worker methods may run collectives (all-reduce): every rank must see calls from
        # several threads in one and the same order, or they would wait on each other.
        executor.collective_rpc("clear_recorded")

        def caller(thread_index: int) -> None:
            for call in range(20):
                executor.collective_rpc("record", args=((thread_index, call),), timeout=60)

        threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a caller thread hung"
        recorded = executor.collective_rpc("get_recorded")
        assert len(recorded[0]) == 80
        assert all(seen == recorded[0] for seen in recorded)

    # --- errors ------------------------------------------------------------------------------

    def test_worker_exception_carries_rank_and_traceback(self, executor: Executor) -> None:
        bad = executor.world_size - 1
        with pytest.raises(WorkerError) as info:
            executor.collective_rpc("fail", args=("kaboom",), kwargs={"on_rank": bad})
        err = info.value
        assert err.rank == bad
        assert err.method == "fail"
        assert err.exc_type == "ValueError"
        assert "kaboom" in err.message
        assert "in fail" in err.remote_traceback
        assert "raise ValueError" in err.remote_traceback
        assert isinstance(err.__cause__, ValueError)
        assert f"rank {bad}" in str(err)
        # The executor is still usable after a worker exception.
        assert executor.collective_rpc("get_rank") == list(range(executor.world_size))

    def test_unpicklable_worker_exception(self, executor: Executor) -> None:
        with pytest.raises(WorkerError) as info:
            executor.collective_rpc("fail_unpicklable", args=("cannot pickle me",))
        assert "UnpicklableError" in info.value.exc_type
        assert "cannot pickle me" in info.value.message
        assert "fail_unpicklable" in info.value.remote_traceback
        assert executor.collective_rpc("get_rank") == list(range(executor.world_size))

    def test_unknown_method(self, executor: Executor) -> None:
        with pytest.raises(WorkerError, match="no method 'no_such_method'"):
            executor.collective_rpc("no_such_method")

    def test_timeout(self, executor: Executor) -> None:
        start = time.monotonic()
        with pytest.raises(RPCTimeoutError) as info:
            executor.collective_rpc("slow", args=(self.slow_call_s,), timeout=self.slow_call_s / 5)
        elapsed = time.monotonic() - start
        assert isinstance(info.value, TimeoutError)
        assert info.value.method == "slow"
        assert info.value.ranks, "the error must name the ranks that did not answer"
        assert set(info.value.ranks) <= set(range(executor.world_size))
        assert elapsed < self.slow_call_s * 0.9
        # Still usable: the next call gets its own results, not the late ones.
        assert executor.collective_rpc("echo", args=("after",)) == [
            (r, ("after",), {}) for r in range(executor.world_size)
        ]

    def test_invalid_timeout(self, executor: Executor) -> None:
        with pytest.raises(ValueError, match="timeout"):
            executor.collective_rpc("get_rank", timeout=-1)

    def test_default_timeout_from_config(self, fresh_executor: ExecutorFactory) -> None:
        executor = fresh_executor(rpc_timeout=self.slow_call_s / 5)
        with pytest.raises(RPCTimeoutError):
            executor.collective_rpc("slow", args=(self.slow_call_s,))
        assert executor.collective_rpc("slow", args=(0.0, "ok"), timeout=30) == [
            (r, "ok") for r in range(executor.world_size)
        ]

    # --- execute_model -----------------------------------------------------------------------

    def test_execute_model_returns_output_rank(self, executor: Executor) -> None:
        assert executor.output_rank == executor.world_size - executor.config.tensor_parallel_size
        assert executor.execute_model([1, 2, 3]) == {
            "rank": executor.output_rank,
            "batch": [1, 2, 3],
        }

    def test_execute_model_non_block(self, executor: Executor) -> None:
        futures = [executor.execute_model(i, non_block=True) for i in range(5)]
        assert [f.result(timeout=30)["batch"] for f in futures] == list(range(5))

    def test_max_concurrent_batches(self, executor: Executor) -> None:
        assert executor.max_concurrent_batches >= 1
        if executor.config.pipeline_parallel_size > 1:
            assert executor.max_concurrent_batches == executor.config.pipeline_parallel_size

    # --- sleep / wake ------------------------------------------------------------------------

    def test_sleep_and_wake_up(self, executor: Executor) -> None:
        ws = executor.world_size
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

    def test_sleep_errors(self, executor: Executor) -> None:
        with pytest.raises(SleepStateError, match="level"):
            executor.sleep(level=3)
        with pytest.raises(SleepStateError, match="unknown sleep tags"):
            executor.wake_up(["gpu"])
        with pytest.raises(SleepStateError, match="not asleep"):
            executor.wake_up(["kv_cache"])
        executor.wake_up()  # nothing asleep: a no-op

    # --- health and failure ------------------------------------------------------------------

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

    def test_failure_callbacks_run_once(self, fresh_executor: ExecutorFactory) -> None:
        executor = fresh_executor()
        calls: list[ExecutorFailedError] = []
        executor.register_failure_callback(calls.append)
        error = ExecutorFailedError("simulated failure")
        assert executor.fail(error) is True
        assert executor.fail(ExecutorFailedError("second")) is False
        assert calls == [error]
        late: list[ExecutorFailedError] = []
        executor.register_failure_callback(late.append)
        assert late == [error]
        with pytest.raises(ExecutorFailedError, match="simulated failure"):
            executor.collective_rpc("get_rank")
        with pytest.raises(ExecutorFailedError):
            executor.check_health()

    # --- shutdown ----------------------------------------------------------------------------

    def test_shutdown_is_idempotent_and_final(self, fresh_executor: ExecutorFactory) -> None:
        executor = fresh_executor()
        assert executor.collective_rpc("get_rank") == list(range(executor.world_size))
        executor.shutdown()
        executor.shutdown()
        assert executor.is_closed
        with pytest.raises(ExecutorClosedError):
            executor.collective_rpc("get_rank")
        with pytest.raises(ExecutorClosedError):
            executor.execute_model(None)
        with pytest.raises(ExecutorClosedError):
            executor.check_health()

    def test_context_manager_shuts_down(self, fresh_executor: ExecutorFactory) -> None:
        with fresh_executor() as executor:
            assert executor.collective_rpc("get_rank") == list(range(executor.world_size))
        assert executor.is_closed

    def test_env_reaches_workers(self, fresh_executor: ExecutorFactory) -> None:
        executor = fresh_executor(env={"EXECUTOR_CONFORMANCE_VAR": "set-by-config"})
        assert (
            executor.collective_rpc("get_env", args=("EXECUTOR_CONFORMANCE_VAR",))
            == ["set-by-config"] * executor.world_size
        )

    def test_worker_kwargs(self, fresh_executor: ExecutorFactory) -> None:
        executor = fresh_executor(worker_kwargs={"tag": "kw"})
        assert executor.collective_rpc("get_tag") == ["kw"] * executor.world_size

    def test_worker_init_failure_fails_creation(self, executor_factory: ExecutorFactory) -> None:
        bad = 0

        def create_and_close() -> None:
            executor_factory(worker_kwargs={"fail_init_on_rank": bad}).shutdown()

        with pytest.raises(ExecutorError) as info:
            create_and_close()
        text = str(info.value)
        assert "init_device failed on purpose" in text
        assert f"rank {bad}" in text
