"""The messages of one step: what the driver sends each rank (:class:`StepInput`) and what
the output rank returns (:class:`StepOutput`)."""

from __future__ import annotations

from collections.abc import Iterable

import attrs
import torch

__all__ = ["StepInput", "StepOutput"]


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _int_rows(rows: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(_int_tuple(row) for row in rows)


@attrs.frozen(kw_only=True)
class StepInput:
    """One step of one batch: the new tokens of each of its sequences.

    All sequences of a batch advance together: ``token_ids`` is ``[batch][new tokens]``, the
    prompt on the first step (prefill) and one token per sequence after that (decode), placed
    at positions ``start_pos ..``. ``slots`` are the KV-cache slots of the sequences.
    """

    batch_id: int
    slots: tuple[int, ...] = attrs.field(converter=_int_tuple)
    token_ids: tuple[tuple[int, ...], ...] = attrs.field(converter=_int_rows)
    start_pos: int
    #: Return the last position's logits (float32, on the CPU) as well as the next tokens.
    return_logits: bool = False


@attrs.frozen(kw_only=True)
class StepOutput:
    """What the output rank returns for one step: the greedy next token of each sequence."""

    batch_id: int
    next_tokens: tuple[int, ...]
    logits: torch.Tensor | None
    #: Seconds the output rank spent inside execute_model, up to when its device had finished
    #: the step (on a GPU, the kernels' end, not their launch).
    model_time_s: float
    #: ``time.perf_counter()`` on the output rank when the step started and ended (comparable
    #: with the driver's clock on the same host only); the end is read after the device
    #: finished the step.
    started_at: float
    finished_at: float
