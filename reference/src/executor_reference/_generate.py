"""The driver side: greedy decoding of prompts through an executor, keeping
``max_concurrent_batches`` batches in flight."""

from __future__ import annotations

import collections
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from executor_core import Executor, WorkerDiedError, WorkerError

from ._batches import Batch, make_batches
from ._replay import Recovery
from ._result import GenerationResult
from ._step import StepInput, StepOutput
from ._step_timing import step_records

if TYPE_CHECKING:
    import torch

    from executor_core import Executor

__all__ = ["generate", "make_prompts"]


def make_prompts(num: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``num`` random prompts of ``length`` token ids below ``vocab_size`` (reproducible)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(num)]


def generate(
    executor: Executor,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    batch_size: int = 8,
    max_concurrent_batches: int | None = None,
    return_logits: bool = False,
    on_step: Callable[[int], None] | None = None,
    timeout: float | None = None,
) -> GenerationResult:
    """Greedy-decode ``max_new_tokens`` tokens for each prompt on ``executor``'s
    :class:`~executor_reference.ReferenceWorker` ranks.

    Prompts are batched ``batch_size`` at a time (prompts of equal length share a batch).
    With ``max_concurrent_batches`` > 1 (default: the executor's) that many batches are in
    flight at once: steps are submitted with ``non_block=True`` and each result is turned
    into the batch's next step while the others run (async overlap; needed to keep every
    pipeline stage busy). ``on_step(tokens)`` is called after each step with the tokens it
    produced (for a progress bar). ``timeout`` bounds each step.

    With a recovery policy on the executor (``ExecutorConfig.recovery``), a step that fails
    because a worker died is not lost: once the executor is back, every batch that was in
    flight is resubmitted as a prefill of its sequences so far (the restarted workers hold
    no KV cache), and greedy decoding goes on with the same tokens. Each recovery's time is
    in :attr:`GenerationResult.recoveries`.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, not {max_new_tokens}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, not {batch_size}")
    if not prompts:
        raise ValueError("no prompts to generate from")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    concurrency = max_concurrent_batches or executor.max_concurrent_batches
    if concurrency < 1:
        raise ValueError(f"max_concurrent_batches must be >= 1, not {concurrency}")
    info: dict[str, Any] = executor.collective_rpc(
        "describe", unique_reply_rank=executor.output_rank, timeout=timeout
    )[0]
    longest = max(len(p) for p in prompts) + max_new_tokens - 1
    if longest > info["max_seq_len"]:
        raise ValueError(
            f"a prompt of {max(len(p) for p in prompts)} tokens plus {max_new_tokens} new tokens "
            f"exceeds the model's max_seq_len={info['max_seq_len']}"
        )
    batches = make_batches(prompts, batch_size)
    concurrency = min(concurrency, len(batches))
    needed = concurrency * min(batch_size, max(len(b.prompts) for b in batches))
    if needed > info["kv_slots"]:
        raise ValueError(
            f"{concurrency} batches of up to {batch_size} sequences need {needed} KV-cache slots "
            f"but the workers have kv_slots={info['kv_slots']}; lower batch_size or raise kv_slots"
        )
    free_slots = list(range(info["kv_slots"]))
    pending = collections.deque(batches)
    in_flight: collections.deque[tuple[Batch, StepInput, float, Future[Any] | None]] = (
        collections.deque()
    )
    arrivals: dict[int, float] = {}
    # (step, output, submitted_at, done_at) in order; recorded once the ranks' times are in.
    finished: list[tuple[StepInput, StepOutput, float, float]] = []
    executor.collective_rpc("take_step_times", timeout=timeout)  # drop earlier steps' times

    def submit(batch: Batch) -> None:
        step = batch.next_step(return_logits)
        submitted = time.perf_counter()
        if concurrency == 1:
            in_flight.append((batch, step, submitted, None))
            return
        future: Future[Any] = executor.execute_model(step, non_block=True)
        key = id(future)
        future.add_done_callback(lambda _f: arrivals.__setitem__(key, time.perf_counter()))
        in_flight.append((batch, step, submitted, future))

    def start_next() -> None:
        batch = pending.popleft()
        batch.slots = [free_slots.pop() for _ in batch.prompts]
        submit(batch)

    recovery = Recovery(executor)
    begin = time.perf_counter()
    while pending and len(in_flight) < concurrency:
        start_next()
    while in_flight:
        batch, step, submitted, future = in_flight.popleft()
        try:
            if future is None:
                output = executor.collective_rpc(
                    "execute_model",
                    args=(step,),
                    unique_reply_rank=executor.output_rank,
                    timeout=timeout,
                )[0]
                done = time.perf_counter()
            else:
                output = future.result(timeout)
                done = arrivals.pop(id(future), time.perf_counter())
        except (WorkerDiedError, WorkerError) as failed:
            if not recovery.recovers(failed):
                raise
            # Every batch in flight lost its cache with the workers: replay each, in order
            # (the next call waits for the recovery).
            lost = [batch, *(entry[0] for entry in in_flight)]
            in_flight.clear()
            arrivals.clear()
            recovery.replay(lost, submit)
            continue
        recovery.step_done(done)
        if not isinstance(output, StepOutput):
            raise TypeError(
                f"the output rank returned {type(output).__name__}, not a StepOutput; "
                "is the worker a ReferenceWorker?"
            )
        finished.append((step, output, submitted, done))
        batch.position = step.start_pos + len(step.token_ids[0])
        for seq, token in zip(batch.generated, output.next_tokens, strict=True):
            seq.append(token)
        if return_logits:
            if output.logits is None:
                raise RuntimeError("return_logits was set but the step returned no logits")
            batch.logits.append(output.logits)
        if on_step is not None:
            on_step(len(output.next_tokens))
        if len(batch.generated[0]) < max_new_tokens:
            submit(batch)
        else:
            free_slots.extend(batch.slots)
            if pending:
                start_next()
    wall = time.perf_counter() - begin
    try:
        rank_times: list[dict[str, Any]] = executor.collective_rpc(
            "take_step_times", timeout=timeout
        )
    except WorkerDiedError:  # a death after the last step: the times died with the workers
        if executor.config.recovery is None:
            raise
        rank_times = []
    records = step_records(finished, rank_times)

    tokens: list[list[int]] = [[] for _ in prompts]
    logits: list[torch.Tensor] | None = [] if return_logits else None
    per_prompt_logits: dict[int, torch.Tensor] = {}
    if return_logits:
        import torch  # deferred: the driver needs torch only to stack logits

        for batch in batches:
            stacked = torch.stack(batch.logits, dim=1)  # [batch, steps, vocab]
            for row, index in enumerate(batch.prompt_ids):
                per_prompt_logits[index] = stacked[row]
    for batch in batches:
        for row, index in enumerate(batch.prompt_ids):
            tokens[index] = batch.generated[row]
    if logits is not None:
        logits.extend(per_prompt_logits[i] for i in range(len(prompts)))
    return GenerationResult(
        tokens=tokens,
        logits=logits,
        steps=records,
        wall_time_s=wall,
        max_concurrent_batches=concurrency,
        recoveries=recovery.times,
        lost_ranks=recovery.lost_ranks,
        restarted_ranks=recovery.restarted_ranks,
    )
