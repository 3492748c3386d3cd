"""The core's own cost per call, in one process: ``uni`` against a direct method call.

The ``overhead`` workload times, in one process and in interleaved rounds, a direct call of
the worker's method and the same call through an ``uni`` executor (``collective_rpc`` by name,
and ``execute_model``), with no plugin observing calls and with one (a plugin implementing
``executor_worker_rpc_finished`` that counts the calls): what every call pays for the SDK's
rules and for an engine's metrics plugin, without any transport.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from executor_core import ExecutorConfig, WorkerContext, create_executor, hookimpl
from executor_core.backend import Registry

from ._worker import BenchWorker

__all__ = ["OVERHEAD_LIMITS", "Overhead", "measure_overhead"]

#: Goals (the project's issue 15): µs over the direct call, with one observer installed.
OVERHEAD_LIMITS = {"observed collective_rpc": 2.0, "observed execute_model": 2.0}


class _Observer:
    """A minimal observer plugin: counts the calls it sees."""

    def __init__(self) -> None:
        self.seen = 0

    @hookimpl
    def executor_worker_rpc_finished(
        self, context: WorkerContext, method: str, duration_s: float, error: BaseException | None
    ) -> None:
        self.seen += 1


@dataclass(frozen=True)
class Overhead:
    """µs per call of each way of calling (the median over rounds of each round's mean)."""

    us_per_call: dict[str, float]
    calls: int
    rounds: int

    def over_direct(self) -> dict[str, float]:
        """µs per call over the direct method call, for every way but the direct one."""
        direct = self.us_per_call["direct"]
        return {k: v - direct for k, v in self.us_per_call.items() if k != "direct"}


def _mean_us(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def measure_overhead(calls: int = 20_000, rounds: int = 7) -> Overhead:
    """Time each way of calling for ``calls`` calls in each of ``rounds`` rounds."""
    config = ExecutorConfig(backend="uni", worker_cls=BenchWorker)
    plain_registry = Registry.from_entry_points(allow=["uniproc"])
    observed_registry = Registry.from_entry_points(allow=["uniproc"])
    observer = _Observer()
    observed_registry.register_plugin(observer, "bench-observer")
    with (
        create_executor(config, plain_registry) as plain,
        create_executor(config, observed_registry) as observed,
    ):
        # uni runs the worker in this process: a callable given the worker returns it as is.
        worker: BenchWorker = plain.collective_rpc(lambda w: w)[0]
        ways: dict[str, Callable[[], Any]] = {
            "direct": worker.noop,
            "collective_rpc": lambda: plain.collective_rpc("noop"),
            "execute_model": lambda: plain.execute_model(None),
            "observed collective_rpc": lambda: observed.collective_rpc("noop"),
            "observed execute_model": lambda: observed.execute_model(None),
        }
        samples: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(rounds):
            for name, fn in ways.items():
                samples[name].append(_mean_us(fn, calls))
    if observer.seen < 2 * calls * rounds:
        raise RuntimeError(f"the observer saw {observer.seen} calls, not every observed one")
    return Overhead(
        {name: statistics.median(values) for name, values in samples.items()}, calls, rounds
    )
