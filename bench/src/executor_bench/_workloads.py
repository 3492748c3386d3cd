"""The rows of the benchmark (what is timed), the payloads, and how many calls each gets."""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._options import MIB, format_size
from ._worker import NOOP, SIZE_OF

__all__ = [
    "PAYLOAD_CALLS_MAX",
    "Plan",
    "Row",
    "Summary",
    "format_time",
    "interleave",
    "make_payload",
    "markdown_table",
    "percentile",
]


def make_payload(kind: str, size: int) -> Any:
    """A payload of ``size`` bytes: random ``bytes``, or a random CPU float32 tensor."""
    if kind == "bytes":
        # Random, so that no layer on the way can get away with compressing it.
        return random.randbytes(size)
    import torch

    return torch.rand(size // 4, dtype=torch.float32)


@dataclass(frozen=True)
class Row:
    """One line of the results: a workload, and for payloads the argument's kind and size.

    ``startup`` and ``shutdown`` rows come from the start-up workload: the time from
    creating the side to its first call returned, and the time its shutdown takes.
    """

    workload: str
    kind: str | None = None
    size: int | None = None

    @property
    def key(self) -> str:
        """A stable identifier: ``hot``, ``payload/tensor/1048576``."""
        if self.kind is None or self.size is None:
            return self.workload
        return f"{self.workload}/{self.kind}/{self.size}"

    def title(self, idle_s: float) -> str:
        """How the row is shown (``idle_s`` is the idle time before a cold call)."""
        if self.workload == "hot":
            return "no-op, back to back"
        if self.workload == "cold":
            return f"no-op after {idle_s * 1e3:g} ms idle"
        if self.workload == "startup":
            return "start-up: create to first call returned"
        if self.workload == "shutdown":
            return "shutdown"
        if self.workload in ("nodes", "slurm"):
            what = "no-op" if self.size is None else f"{self.kind} {format_size(self.size)}"
            return f"{'2 nodes' if self.workload == 'nodes' else 'Slurm, 2 nodes'}: {what}"
        assert self.size is not None
        return f"{self.kind} {format_size(self.size)}"

    @classmethod
    def from_key(cls, key: str) -> Row:
        """The row whose :attr:`key` is ``key``."""
        workload, _, rest = key.partition("/")
        if not rest:
            return cls(workload)
        kind, _, size = rest.partition("/")
        return cls(workload, kind, int(size))

    @property
    def method(self) -> str:
        """The worker method the row calls: a row with an argument, ``size_of``."""
        return NOOP if self.size is None else SIZE_OF


#: The most timed calls a payload row gets in a round (see :attr:`Plan.payload_bytes`).
PAYLOAD_CALLS_MAX = 10


@dataclass(frozen=True)
class Plan:
    """How many calls each row gets: per round, and before the rounds (warm-up)."""

    #: Interleaved rounds: in each, every side runs every row once, in a rotating order.
    rounds: int
    #: Timed calls per round: back-to-back no-ops, no-ops after idle, calls per payload size.
    hot_calls: int
    cold_calls: int
    payload_calls: int
    #: Start-up samples per side (each starts and stops the side's workers: seconds).
    startup_samples: int
    #: Idle time before each cold call.
    idle_s: float
    #: Untimed calls per payload row before the rounds: at most this many bytes each, at
    #: least 2 and at most 12 calls. vLLM's ring has 10 chunks whose first write takes the
    #: page faults; the other sides' rings and allocators warm up alike.
    warmup_bytes: int
    #: Timed calls per round of each ``nodes`` and ``slurm`` row (a no-op, a 1 MiB argument).
    nodes_calls: int = 25
    #: A payload row gets more than ``payload_calls`` calls a round, up to
    #: :data:`PAYLOAD_CALLS_MAX`, while they carry at most this many bytes: a median of a few
    #: calls of 64 KiB is decided by the machine's noise, and more of them cost little time.
    payload_bytes: int = 0

    @classmethod
    def create(cls, *, quick: bool, repeats: int | None, idle_s: float) -> Plan:
        """The default plan, or ``quick``'s (fewer calls: for a first look, not a record)."""
        rounds = repeats if repeats is not None else (2 if quick else 10)
        if quick:
            return cls(rounds, 40, 10, 1, 1, idle_s, 32 * MIB, 5)
        # 1000 back-to-back no-ops a round: the p99 of 1000 calls would be their 10th
        # slowest, which a handful of the machine's own pauses (a process taken off its core
        # for tens of µs) decides; over the ten rounds' 10000 it is a figure of the calls.
        # They cost little time, except on the slowest side (raw Ray actor calls).
        # Ten rounds: a target's interval is a bootstrap over rounds, and over five it spans
        # the lowest round to the highest (a target is met only if every round meets it);
        # the no-ops after idle and the payload calls are spread over them, not added.
        return cls(rounds, 1000, 20, 2, min(rounds, 3), idle_s, 256 * MIB, payload_bytes=8 * MIB)

    def calls(self, row: Row) -> int:
        """Timed calls of ``row`` per round."""
        if row.size is not None and row.workload == "payload":
            fit = min(PAYLOAD_CALLS_MAX, self.payload_bytes // row.size)
            return max(self.payload_calls, fit)
        calls = {"hot": self.hot_calls, "cold": self.cold_calls, "nodes": self.nodes_calls}
        return calls.get(
            row.workload, self.nodes_calls if row.workload == "slurm" else self.payload_calls
        )

    def warmup_calls(self, row: Row) -> int:
        """Untimed calls of ``row`` before the first round."""
        if row.size is None:
            return 12
        return max(2, min(12, self.warmup_bytes // row.size))


def percentile(samples: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of ``samples``: an observed value."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass(frozen=True)
class Summary:
    """The summary of one side's samples of one row, in seconds."""

    n: int
    median_s: float
    p99_s: float
    mean_s: float
    min_s: float
    max_s: float

    @classmethod
    def of(cls, samples: list[float]) -> Summary:
        """Summarise ``samples`` (at least one)."""
        return cls(
            n=len(samples),
            median_s=statistics.median(samples),
            p99_s=percentile(samples, 0.99),
            mean_s=statistics.fmean(samples),
            min_s=min(samples),
            max_s=max(samples),
        )


def interleave(
    sides: Mapping[str, Callable[[], Any]], rounds: int, calls: int, *, warmup: int = 0
) -> dict[str, list[float]]:
    """Seconds per call of each side: ``warmup`` untimed calls each, then ``rounds`` rounds
    in which every side makes ``calls`` timed calls, which side goes first rotating, so that
    the machine's noise falls on all of them alike (the loop of a workload measured apart;
    the sides' is :mod:`executor_bench._timing`)."""
    for call in sides.values():
        for _ in range(warmup):
            call()
    out: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    clock = time.perf_counter
    for turn in range(rounds):
        shift = turn % len(names)
        for name in names[shift:] + names[:shift]:
            call = sides[name]
            for _ in range(calls):
                start = clock()
                call()
                out[name].append(clock() - start)
    return out


def format_time(seconds: float) -> str:
    """Three significant figures in a unit that suits: µs, ms or s."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e6:.3g} µs"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table of ``rows`` (cells written with ``str``) under ``header``."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
