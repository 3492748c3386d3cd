"""A generation's batches: prompts of equal length grouped, each batch's sequences so far
turned into its next step."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from ._step import StepInput

if TYPE_CHECKING:
    import torch

__all__ = ["Batch", "make_batches"]


@attrs.define
class Batch:
    """One batch of a generation: its prompts, KV slots and tokens so far."""

    batch_id: int
    prompt_ids: list[int]  # indices into the prompt list
    prompts: list[list[int]]
    slots: list[int] = attrs.Factory(list)
    generated: list[list[int]] = attrs.Factory(list)
    logits: list[torch.Tensor] = attrs.Factory(list)
    position: int = 0
    #: Set after a recovery: the workers lost this batch's KV cache, so its next step is a
    #: prefill of each sequence so far (prompt and tokens generated), from position 0.
    replay: bool = False

    def next_step(self, return_logits: bool) -> StepInput:
        """The step that advances every sequence of the batch by one token."""
        # The prompts on the first step (prefill), then each sequence's latest token.
        tokens = [[seq[-1]] for seq in self.generated] if self.generated[0] else self.prompts
        if self.replay:
            self.replay = False
            self.position = 0
            tokens = [p + g for p, g in zip(self.prompts, self.generated, strict=True)]
        return StepInput(
            batch_id=self.batch_id,
            slots=self.slots,
            token_ids=tokens,
            start_pos=self.position,
            return_logits=return_logits,
        )


def make_batches(prompts: Sequence[Sequence[int]], batch_size: int) -> list[Batch]:
    """Group prompts of equal length (sequences of a batch advance in lockstep)."""
    by_length: dict[int, list[int]] = collections.defaultdict(list)
    for index, prompt in enumerate(prompts):
        by_length[len(prompt)].append(index)
    batches: list[Batch] = []
    for length in sorted(by_length):
        indices = by_length[length]
        for start in range(0, len(indices), batch_size):
            chunk = indices[start : start + batch_size]
            batches.append(
                Batch(
                    batch_id=len(batches),
                    prompt_ids=chunk,
                    prompts=[list(prompts[i]) for i in chunk],
                    generated=[[] for _ in chunk],
                )
            )
    return batches
