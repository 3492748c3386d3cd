"""What :func:`~executor_reference.generate` returns: the tokens (and logits) per prompt,
every step's record, the shares of time derived from them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from ._step_timing import StepRecord

if TYPE_CHECKING:
    import torch

__all__ = ["GenerationResult"]


@attrs.frozen(kw_only=True)
class GenerationResult:
    """Generated tokens (and logits, if asked) per prompt, and the timing of every step."""

    #: The new tokens of each prompt, in prompt order.
    tokens: list[list[int]]
    #: Per prompt, the logits ``[max_new_tokens, vocab]`` of each generated position.
    logits: list[torch.Tensor] | None
    steps: list[StepRecord]
    wall_time_s: float
    max_concurrent_batches: int
    #: Per recovery from a worker's death (an executor with a recovery policy): seconds
    #: from the failed step to the first step that succeeded after it.
    recoveries: list[float] = attrs.Factory(list)
    #: The ranks whose death each recovery answered.
    lost_ranks: list[tuple[int, ...]] = attrs.Factory(list)
    #: The ranks each recovery started again: the dead ones (a rank replacement) or every
    #: rank (a group restart).
    restarted_ranks: list[tuple[int, ...]] = attrs.Factory(list)

    @property
    def generated_tokens(self) -> int:
        """Total tokens generated."""
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of wall time."""
        return self.generated_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def latency_percentile(self, q: float) -> float:
        """The ``q``-th percentile (0..100) of step latency, in seconds (nearest rank)."""
        latencies = sorted(s.latency_s for s in self.steps)
        if not latencies:
            return 0.0
        index = min(len(latencies) - 1, max(0, round(q / 100 * len(latencies) + 0.5) - 1))
        return latencies[index]

    @property
    def step_time_s(self) -> float:
        """The steps' latencies summed. Without batches in flight at once this is about the
        wall time; with several, steps overlap and it is up to that many times more."""
        return sum(s.latency_s for s in self.steps)

    @property
    def executor_share(self) -> float:
        """Share of the steps' time spent in the executor (transport, not the model): each
        step's executor time over its latency, weighted by latency. With batches in flight at
        once every step still counts its own executor time against its own latency."""
        step_time = self.step_time_s
        if step_time <= 0:
            return 0.0
        return sum(s.executor_time_s for s in self.steps) / step_time

    @property
    def executor_time_per_wall_s(self) -> float:
        """Executor seconds per second of wall time, summed over steps in flight at once. The
        same as :attr:`executor_share` with one batch in flight; with ``n`` it can be up to
        ``n`` times that, though no step lost more than its own share."""
        if self.wall_time_s <= 0:
            return 0.0
        return sum(s.executor_time_s for s in self.steps) / self.wall_time_s

    @property
    def model_share(self) -> float:
        """Share of the steps' time the output rank spent in the model."""
        step_time = self.step_time_s
        if step_time <= 0:
            return 0.0
        return min(1.0, sum(s.model_time_s for s in self.steps) / step_time)
