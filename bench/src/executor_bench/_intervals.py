"""How a target is judged: per-round figures, a bootstrap over rounds, and a verdict.

Each round of a run times every side alike, so a round gives one paired figure: this side's
statistic over the baseline's (a ratio), or this way's µs over the direct call's (a
difference). The estimate is the median of those per-round figures; its interval is a
percentile bootstrap over rounds (rounds drawn with replacement, with a fixed seed, so that a
report is reproducible). A p99 of fewer than :data:`MIN_P99_CALLS` calls says little, so for a
p99 adjacent rounds are first pooled into blocks of at least that many calls, and the
bootstrap draws blocks (a block bootstrap).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._workloads import percentile

__all__ = [
    "CONFIDENCE",
    "MIN_P99_CALLS",
    "MIN_UNITS",
    "RESAMPLES",
    "Estimate",
    "blocks",
    "bootstrap",
    "count",
    "difference_estimate",
    "judged",
    "ratio_estimate",
]

#: The interval's coverage, the resamples drawn, and the seed of every bootstrap.
CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 15
#: The fewest calls a p99 is taken over: a block of adjacent rounds holds at least this many.
MIN_P99_CALLS = 100
#: The fewest rounds (or blocks) for a verdict: below it a 95% percentile interval covers
#: far less often than it says (about 3 times in 4 with 3 rounds), so the target is undecided.
MIN_UNITS = 5


@dataclass(frozen=True)
class Estimate:
    """A figure with its interval, from ``units`` rounds or blocks of rounds."""

    point: float
    low: float
    high: float
    units: int
    #: Whether adjacent rounds were pooled into blocks (a p99 of rounds with few calls),
    #: and the most rounds in a block.
    blocked: bool = False
    rounds_per_block: int = 1

    def verdict(self, limit: float) -> str:
        """``met`` if the whole interval is within ``limit``, ``not met`` if it is wholly
        beyond it, else ``undecided`` (as with fewer than :data:`MIN_UNITS` units)."""
        if self.units < MIN_UNITS:
            return "undecided"
        if self.high <= limit:
            return "met"
        if self.low > limit:
            return "not met"
        return "undecided"


def bootstrap(
    values: Sequence[float],
    *,
    resamples: int = RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = SEED,
) -> tuple[float, float, float]:
    """The median of ``values`` (at least one) and a ``confidence`` percentile bootstrap
    interval for it: ``(point, low, high)``."""
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    tail = (1 - confidence) / 2
    low = medians[int(tail * resamples)]
    high = medians[min(resamples - 1, int((1 - tail) * resamples))]
    return statistics.median(values), low, high


def blocks(sizes: Sequence[int], min_calls: int) -> list[range]:
    """Adjacent round indices pooled so that each block's ``sizes`` sum to ``min_calls``
    or more; a short remainder joins the last block (all rounds: one block)."""
    out: list[range] = []
    start = total = 0
    for index, size in enumerate(sizes):
        total += size
        if total >= min_calls:
            out.append(range(start, index + 1))
            start, total = index + 1, 0
    if start < len(sizes):
        if out:
            out[-1] = range(out[-1].start, len(sizes))
        else:
            out.append(range(start, len(sizes)))
    return out


def _statistic(samples: list[float], name: str) -> float:
    return percentile(samples, 0.99) if name == "p99" else statistics.median(samples)


def ratio_estimate(
    mine: Sequence[Sequence[float]], theirs: Sequence[Sequence[float]], statistic: str
) -> Estimate:
    """``statistic`` (``median`` or ``p99``) of each round of ``mine`` over that of the same
    round of ``theirs``: their median and its interval; for a p99, over blocks of adjacent
    rounds of at least :data:`MIN_P99_CALLS` calls when a round has fewer."""
    rounds = min(len(mine), len(theirs))
    sizes = [min(len(mine[r]), len(theirs[r])) for r in range(rounds)]
    blocked = statistic == "p99" and min(sizes, default=0) < MIN_P99_CALLS
    groups = blocks(sizes, MIN_P99_CALLS if blocked else 1)
    ratios = [
        _statistic([x for r in group for x in mine[r]], statistic)
        / _statistic([x for r in group for x in theirs[r]], statistic)
        for group in groups
    ]
    return Estimate(*bootstrap(ratios), len(groups), blocked, max(len(g) for g in groups))


def difference_estimate(mine: Sequence[float], theirs: Sequence[float]) -> Estimate:
    """Each round's ``mine`` minus the same round's ``theirs`` (one figure a round): their
    median and its interval."""
    differences = [a - b for a, b in zip(mine, theirs, strict=True)]
    return Estimate(*bootstrap(differences), len(differences))


def count(n: int, thing: str) -> str:
    """``n`` things, in words: ``1 round``, ``3 rounds``."""
    return f"{n} {thing}{'' if n == 1 else 's'}"


def judged(estimate: Estimate, limit: float, unit: str, what: str) -> dict[str, Any]:
    """A target's verdict, interval and note (how it was judged), for the JSON document."""
    verdict = estimate.verdict(limit)
    notes = [f"median of {count(estimate.units, what)}"]
    if estimate.blocked:
        notes[0] = (
            f"median of {count(estimate.units, 'block')} of adjacent rounds (up to "
            f"{estimate.rounds_per_block} a block: a round has fewer than {MIN_P99_CALLS} "
            "calls for a p99), block bootstrap"
        )
    if estimate.units < MIN_UNITS:
        notes.append(f"too few for a verdict ({MIN_UNITS} needed)")
    return {
        "interval": [estimate.low, estimate.high],
        "verdict": verdict,
        "met": verdict == "met",
        "units": estimate.units,
        "note": "; ".join(notes) + f"; {CONFIDENCE:.0%} bootstrap interval ({unit})",
    }
