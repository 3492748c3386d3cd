"""Conformance kit, errors and timeouts: worker exceptions, the lowest failing rank, health."""

from __future__ import annotations

import threading
import time

import pytest

from .._errors import ExecutorError, ExecutorFailedError, RPCTimeoutError, WorkerError
from .._executor import Executor
from ._base import ExecutorFactory, KitBase

__all__ = ["ErrorTests"]


class ErrorTests(KitBase):
    """A worker exception raises :class:`WorkerError` with the worker's traceback."""

    def test_worker_exception_carries_rank_and_traceback(self, executor: Executor) -> None:
        bad = executor.world_size - 1
        with pytest.raises(WorkerError) as info:
            executor.collective_rpc("fail", args=("kaboom",), kwargs={"on_rank": bad})
        err = info.value
        assert err.rank == bad, "rule broken: a WorkerError names the rank that raised"
        assert err.method == "fail"
        assert err.exc_type == "ValueError"
        assert "kaboom" in err.message
        assert "in fail" in err.remote_traceback
        assert "raise ValueError" in err.remote_traceback
        assert isinstance(err.__cause__, ValueError)
        assert f"rank {bad}" in str(err)
        assert executor.collective_rpc("get_rank") == list(range(executor.world_size)), (
            "rule broken: the executor stays usable after a worker exception"
        )

    def test_lowest_failing_rank_wins(self, executor: Executor) -> None:
        # The highest rank fails first; the error raised must still be the lowest rank's.
        with pytest.raises(WorkerError) as info:
            executor.collective_rpc("fail_later_on_lower_ranks", args=(0.2,), timeout=30)
        assert info.value.rank == 0, (
            f"rule broken: when several ranks fail, the lowest failing rank's error is raised "
            f"(got rank {info.value.rank}'s, the first to arrive)"
        )
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
        assert executor.collective_rpc("echo", args=("after",)) == [
            (r, ("after",), {}) for r in range(executor.world_size)
        ], "rule broken: after a timeout the next call gets its own results, not late ones"

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

    def test_unsendable_call_fails_by_its_deadline(self, fresh_executor: ExecutorFactory) -> None:
        """Rule: with a rank hung in a call, a call that cannot be sent (``large_call_bytes``,
        more than any queue or ring of the backend holds) still fails by its deadline
        (``Transport.send`` returns False once ``call.deadline`` passed: wait for room with a
        timeout), with :class:`RPCTimeoutError`, or with :class:`ExecutorFailedError` where a
        call left half-sent puts the backend's queues out of step (``mp``'s rings); and
        ``shutdown()`` returns within ``shutdown_s``."""
        executor = fresh_executor()
        hung = executor.world_size - 1
        executor.collective_rpc("hang", args=(self.slow_call_s * 3, hung), non_block=True)
        time.sleep(self.slow_call_s / 5)  # the rank is in the call
        data = bytes(self.large_call_bytes)
        timeout = self.slow_call_s / 2
        margin = self.slow_call_s
        outcome: list[BaseException | None] = []

        def call() -> None:
            try:
                executor.collective_rpc("payload_size", args=(data,), timeout=timeout)
            except BaseException as exc:  # noqa: BLE001 - checked in the test's thread
                outcome.append(exc)
            else:
                outcome.append(None)

        caller = threading.Thread(target=call, name="conformance-large-call", daemon=True)
        start = time.monotonic()
        caller.start()
        caller.join(timeout + margin)
        took = time.monotonic() - start
        if caller.is_alive():
            # Unstick the send (fail() interrupts the transport) so that the test ends now.
            executor.fail(ExecutorFailedError("conformance kit: a send ran past its deadline"))
            caller.join(self.settle_s)
            pytest.fail(
                f"rule broken: with a rank hung, a call that cannot be sent fails by its "
                f"deadline ({timeout:g} s); it still waited after {took:.1f} s (Transport.send "
                "must return False once call.deadline passed)"
            )
        assert outcome, "the large call's thread ended without an outcome"
        assert isinstance(outcome[0], RPCTimeoutError | ExecutorFailedError), (
            f"rule broken: with a rank hung, a call that cannot be sent fails by its deadline "
            f"with RPCTimeoutError (or ExecutorFailedError), not {outcome[0]!r}"
        )
        self.assert_prompt_shutdown(executor, "with a rank hung")
