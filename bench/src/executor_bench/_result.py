"""What a run measured: every sample, by row and side, and what the run left out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ._config import BenchConfig
from ._intervals import Estimate, bootstrap, judged
from ._overhead import Overhead
from ._sides import SideSpec, Skipped
from ._workloads import Plan, Row

__all__ = ["BenchResult", "Table"]


@dataclass
class Table:
    """A workload measured apart from the sides (``_options.APART``): its table, as written,
    and its targets."""

    workload: str
    #: What the table shows, in a sentence or two: what is timed, how often, the setting.
    about: str
    header: list[str]
    rows: list[list[str]] = field(default_factory=list)
    targets: list[dict[str, Any]] = field(default_factory=list)

    def judge(self, title: str, ratios: Sequence[float], limit: float) -> None:
        """Add the target ``title``: ``ratios`` (one a round: ours over the baseline's) at
        most ``limit``, judged as the run's other targets are."""
        estimate = Estimate(*bootstrap(ratios), len(ratios))
        verdict = judged(estimate, limit, "ratio", "per-round ratio")
        self.targets.append({"title": title, "ratio": estimate.point, "limit": limit, **verdict})


@dataclass
class BenchResult:
    """Everything a run measured, and what it left out."""

    config: BenchConfig
    plan: Plan
    #: The sides measured (a failed one is not among them).
    sides: list[SideSpec]
    #: Sides that cannot run here (not installed, not standalone), with the reason.
    skipped: list[Skipped]
    #: Sides that failed once started (an error, a wrong reply), with the reason.
    failed: list[Skipped]
    #: The rows, in report order.
    rows: list[Row]
    #: (row key, side name) -> seconds per call.
    samples: dict[tuple[str, str], list[float]]
    #: (row key, side name) -> calls in each round of its samples, in order (none recorded:
    #: the samples are one round).
    round_calls: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    #: Facts for the report: the plugins loaded, Ray's start, each phase's duration...
    facts: dict[str, str] = field(default_factory=dict)
    wall_s: float = 0.0
    #: The ``overhead`` workload's figures (None if not measured).
    overhead: Overhead | None = None
    #: The ``imports`` workload's ms per import, by label (None if not measured).
    imports: dict[str, float] | None = None
    #: The workloads measured apart, each a table.
    tables: list[Table] = field(default_factory=list)

    def summary_rows(self) -> list[tuple[Row, SideSpec, list[float]]]:
        """Each (row, side) that has samples, in report order."""
        return [
            (row, side, self.samples[row.key, side.name])
            for row in self.rows
            for side in self.sides
            if self.samples.get((row.key, side.name))
        ]

    def rounds(self, row: str, side: str) -> list[list[float]]:
        """The samples of ``row`` (a key) and ``side``, round by round."""
        samples = self.samples.get((row, side), [])
        out, start = [], 0
        for calls in self.round_calls.get((row, side), [len(samples)]):
            out.append(samples[start : start + calls])
            start += calls
        return out
