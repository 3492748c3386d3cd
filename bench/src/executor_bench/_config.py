"""What ``executor bench`` is asked to measure: its options, checked, as one record."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BenchConfig"]


@dataclass(frozen=True)
class BenchConfig:
    """What ``executor bench`` was asked to measure (its options, checked)."""

    #: Backend names or aliases; ``None``: every installed one.
    backends: Sequence[str] | None
    #: Baseline keys (``pipe``, ``ray``, ``vllm``).
    baselines: Sequence[str]
    sizes: Sequence[int]
    #: Payload kinds; ``None``: both, tensors only where torch is installed.
    kinds: Sequence[str] | None
    workloads: Sequence[str]
    #: Rounds; ``None``: the plan's default.
    repeats: int | None
    workers: int
    quick: bool
    idle_s: float
    vllm_path: str | None
    #: Load every installed plugin, not only those of the measured backends.
    all_plugins: bool = False
    progress: bool = True
