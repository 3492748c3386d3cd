"""Where each step's time went, as the driver saw it: in the model or in the executor, from
the driver's clock and every rank's own start and finish times."""

from __future__ import annotations

from typing import Any

import attrs

from ._step import StepInput, StepOutput

__all__ = ["StepRecord", "step_records"]


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


@attrs.frozen
class _RankStep:
    """One rank's run of one step (``time.perf_counter`` on that rank)."""

    pp_rank: int
    tp_rank: int
    started: float
    ended: float
    #: When this rank finished the step it ran before this one (0.0: none).
    previous_end: float


def step_records(
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
        # This run of the step: after a recovery, steps run again (the same batch and
        # position) and a survivor's times hold both runs; each record takes the ranks' run
        # that started while it was in flight.
        ranks = [
            r
            for r in by_step.get((step.batch_id, step.start_pos), [])
            if submitted <= r.started <= done
        ]
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
