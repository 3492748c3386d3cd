"""Recovery replay in generation: the steps lost to a worker's death are run again.

With a recovery policy on the executor (``ExecutorConfig.recovery``), a step's failure is
checked for a worker's death behind it; once the executor is back, every batch that was in
flight is resubmitted as a prefill of its sequences so far (a new worker holds no KV cache,
and a survivor's is rewritten from the first position), so that greedy decoding goes on
with the same tokens. Each recovery is timed from the failed step to the first step that
succeeds after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from executor_core import Executor, ExecutorState, WorkerDiedError

from ._batches import Batch

__all__ = ["Recovery"]


#: Seconds a step's worker error may come before the executor sees the death behind it (a
#: survivor's collective fails at once when its peer dies; the death is seen a moment later).
_DEATH_SEEN_S = 5.0


def _died(executor: Executor, error: BaseException) -> bool:
    """Whether a step's failure comes from a worker's death (the executor recovers)."""
    if isinstance(error, WorkerDiedError):
        return True
    deadline = time.monotonic() + _DEATH_SEEN_S
    while executor.state is ExecutorState.RUNNING and time.monotonic() < deadline:
        time.sleep(0.01)
    return executor.state is ExecutorState.RECOVERING


def _lost(executor: Executor, error: BaseException) -> tuple[int, ...]:
    if isinstance(error, WorkerDiedError):
        return tuple(error.ranks)
    death = executor.last_death
    return tuple(death.ranks) if death is not None else ()


class Recovery:
    """The recoveries of one :func:`~executor_reference.generate` call."""

    def __init__(self, executor: Executor) -> None:
        self._executor = executor
        #: Per recovery: seconds from the failed step to the first step that succeeded after it.
        self.times: list[float] = []
        #: The ranks whose death each recovery answered.
        self.lost_ranks: list[tuple[int, ...]] = []
        #: The ranks each recovery started again (``Executor.last_recovery``).
        self.restarted_ranks: list[tuple[int, ...]] = []
        self._failed_at: float | None = None

    def recovers(self, error: BaseException) -> bool:
        """Whether a step's failure comes from a worker's death the executor recovers from;
        the first failure of a recovery starts its clock."""
        if self._executor.config.recovery is None or not _died(self._executor, error):
            return False
        if self._failed_at is None:
            self._failed_at = time.perf_counter()
            self.lost_ranks.append(_lost(self._executor, error))
        return True

    def replay(self, lost: Iterable[Batch], submit: Callable[[Batch], None]) -> None:
        """Resubmit each batch of ``lost``, in order, as a prefill of its sequences so far
        (the next call waits for the recovery)."""
        for batch in lost:
            batch.replay = True
            submit(batch)

    def step_done(self, done: float) -> None:
        """A step's result arrived at ``done``: the recovery in progress, if any, is over."""
        if self._failed_at is not None:
            self.times.append(done - self._failed_at)
            self._failed_at = None
            record = self._executor.last_recovery
            self.restarted_ranks.append(record.restarted if record is not None else ())
