"""The driver side: batches prompts and runs greedy decoding through an executor, keeping
``max_concurrent_batches`` batches in flight."""

from __future__ import annotations

import collections
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import attrs

from executor_core import Executor, ExecutorState, WorkerDiedError, WorkerError

from ._worker import StepInput, StepOutput

if TYPE_CHECKING:
    import torch

    from executor_core import Executor

__all__ = ["GenerationResult", "StepRecord", "generate", "make_prompts"]


def make_prompts(num: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``num`` random prompts of ``length`` token ids below ``vocab_size`` (reproducible)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(num)]


@attrs.frozen(kw_only=True)
class StepRecord:
    """Timing of one execute_model call, as the driver saw it."""

    batch_id: int
    prefill: bool
    #: Sequences in the batch (tokens produced by the step).
    tokens: int
    #: ``perf_counter`` when the driver submitted the step and when its result arrived.
    submitted_at: float
    done_at: float
    #: Seconds the output rank spent inside execute_model, less any part of it spent waiting
    #: for a rank that the executor was late to start (that is executor time).
    model_time_s: float
    #: Seconds the step spent in the executor: how late the latest rank started it (after
    #: the step was submitted, that rank had finished its previous step and, on a later
    #: pipeline stage, the previous stage had finished this one), plus the way back from the
    #: output rank to the driver. Same-host clocks (``time.perf_counter``).
    executor_time_s: float

    @property
    def latency_s(self) -> float:
        """Submit to result."""
        return self.done_at - self.submitted_at


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


@attrs.define
class _Batch:
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


def _make_batches(prompts: Sequence[Sequence[int]], batch_size: int) -> list[_Batch]:
    """Group prompts of equal length (sequences of a batch advance in lockstep)."""
    by_length: dict[int, list[int]] = collections.defaultdict(list)
    for index, prompt in enumerate(prompts):
        by_length[len(prompt)].append(index)
    batches: list[_Batch] = []
    for length in sorted(by_length):
        indices = by_length[length]
        for start in range(0, len(indices), batch_size):
            chunk = indices[start : start + batch_size]
            batches.append(
                _Batch(
                    batch_id=len(batches),
                    prompt_ids=chunk,
                    prompts=[list(prompts[i]) for i in chunk],
                    generated=[[] for _ in chunk],
                )
            )
    return batches


@attrs.frozen
class _RankStep:
    """One rank's run of one step (``time.perf_counter`` on that rank)."""

    pp_rank: int
    tp_rank: int
    started: float
    ended: float
    #: When this rank finished the step it ran before this one (0.0: none).
    previous_end: float


def _step_records(
    finished: list[tuple[StepInput, StepOutput, float, float]], rank_times: list[dict[str, Any]]
) -> list[StepRecord]:
    """One record per ``(step, output, submitted_at, done_at)``, its executor time taken
    from every rank's own start and finish times.

    The way in is the delay of the latest rank: how long after it could have started the
    step (submitted, its previous step done and, on a later pipeline stage, the previous
    stage done with this step) it did. A later stage that starts while the previous stage is
    still computing would wait for that stage anyway, so its delay is not on the step's path.
    The way back is from the output rank's finish to the driver's receipt.
    """
    by_step: dict[tuple[int, int], list[_RankStep]] = {}
    for times in rank_times:
        previous_end = 0.0
        for batch_id, start_pos, started, ended in times["steps"]:
            by_step.setdefault((batch_id, start_pos), []).append(
                _RankStep(times["pp_rank"], times["tp_rank"], started, ended, previous_end)
            )
            previous_end = ended
    records: list[StepRecord] = []
    for step, output, submitted, done in finished:
        ranks = by_step.get((step.batch_id, step.start_pos), [])
        if ranks:
            late_from = late_to = 0.0
        else:  # no rank kept times for it (dropped, or another worker): the output rank's
            late_from, late_to = submitted, output.started_at
        ends = {(r.pp_rank, r.tp_rank): r.ended for r in ranks}
        for r in ranks:
            upstream_end = ends.get((r.pp_rank - 1, r.tp_rank), 0.0) if r.pp_rank > 0 else 0.0
            could_start = max(submitted, r.previous_end, upstream_end)
            if r.started - could_start > late_to - late_from:
                late_from, late_to = could_start, r.started
        late = max(0.0, late_to - late_from)
        back = max(0.0, done - output.finished_at)
        # The output rank spent that delay waiting inside execute_model (for the late rank's
        # collective): executor time, so not also model time.
        waited = max(0.0, min(late_to, output.finished_at) - max(late_from, output.started_at))
        records.append(
            StepRecord(
                batch_id=step.batch_id,
                prefill=step.start_pos == 0,
                tokens=len(output.next_tokens),
                submitted_at=submitted,
                done_at=done,
                model_time_s=max(0.0, output.model_time_s - waited),
                executor_time_s=late + back,
            )
        )
    return records


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
    batches = _make_batches(prompts, batch_size)
    concurrency = min(concurrency, len(batches))
    needed = concurrency * min(batch_size, max(len(b.prompts) for b in batches))
    if needed > info["kv_slots"]:
        raise ValueError(
            f"{concurrency} batches of up to {batch_size} sequences need {needed} KV-cache slots "
            f"but the workers have kv_slots={info['kv_slots']}; lower batch_size or raise kv_slots"
        )
    free_slots = list(range(info["kv_slots"]))
    pending = collections.deque(batches)
    in_flight: collections.deque[tuple[_Batch, StepInput, float, Future[Any] | None]] = (
        collections.deque()
    )
    arrivals: dict[int, float] = {}
    # (step, output, submitted_at, done_at) in order; recorded once the ranks' times are in.
    finished: list[tuple[StepInput, StepOutput, float, float]] = []
    executor.collective_rpc("take_step_times", timeout=timeout)  # drop earlier steps' times

    def submit(batch: _Batch) -> None:
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

    recoveries: list[float] = []
    lost_ranks: list[tuple[int, ...]] = []
    failed_at: float | None = None
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
            if executor.config.recovery is None or not _died(executor, failed):
                raise
            if failed_at is None:
                failed_at = time.perf_counter()
                lost_ranks.append(_lost(executor, failed))
            # Every batch in flight lost its cache with the workers: replay each, in order
            # (the next call waits for the recovery).
            lost = [batch, *(entry[0] for entry in in_flight)]
            in_flight.clear()
            arrivals.clear()
            for replayed in lost:
                replayed.replay = True
                submit(replayed)
            continue
        if failed_at is not None:
            recoveries.append(done - failed_at)
            failed_at = None
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
    records = _step_records(finished, rank_times)

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
        recoveries=recoveries,
        lost_ranks=lost_ranks,
    )
