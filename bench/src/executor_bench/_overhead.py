"""The core's own cost, in one process: import times, and ``uni`` against a direct call.

The ``imports`` workload times imports in fresh interpreters (the median of several), beside
importing attrs and pluggy alone. The ``overhead`` workload times, in one process and in
interleaved rounds, a direct call of the worker's method and the same call through an ``uni``
executor (``collective_rpc`` by name and by callable, ``execute_model``, and a
``non_block=True`` call then its ``.result()``), with no plugin observing calls, with one
worker-side observer (``executor_worker_rpc_finished``, counting the calls: what an engine's
metrics plugin costs) and with one driver-side observer (``executor_call_started`` and
``_finished``): what every call pays for the SDK's rules, without any transport.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from executor_core import ExecutorConfig, WorkerContext, create_executor, hookimpl
from executor_core.backend import Registry

from ._intervals import Estimate, difference_estimate
from ._worker import BenchWorker

__all__ = [
    "IMPORTS",
    "OVERHEAD_LIMITS",
    "CallObserver",
    "Overhead",
    "RpcObserver",
    "import_ms",
    "measure_imports",
    "measure_overhead",
    "per_call_us",
]

#: Goals (the project's issue 15): µs over the direct call, with one observer installed.
OVERHEAD_LIMITS = {"observed collective_rpc": 2.0, "observed execute_model": 2.0}
#: What the ``imports`` workload times, by label.
IMPORTS = {
    "import executor_core": "import executor_core",
    "the users' API (Executor, ExecutorConfig, hookimpl, create_executor)": (
        "from executor_core import Executor, ExecutorConfig, hookimpl, create_executor"
    ),
    "baseline: import attrs": "import attrs",
    "baseline: import pluggy": "import pluggy",
}


class RpcObserver:
    """A minimal worker-side observer plugin: counts the calls it sees."""

    def __init__(self) -> None:
        self.seen = 0

    @hookimpl
    def executor_worker_rpc_finished(
        self, context: WorkerContext, method: str, duration_s: float, error: BaseException | None
    ) -> None:
        self.seen += 1


class CallObserver:
    """A minimal driver-side observer plugin: counts the calls it sees start and finish."""

    def __init__(self) -> None:
        self.started = 0
        self.finished = 0

    @hookimpl
    def executor_call_started(
        self, backend: str, method: str, call_id: int, world_size: int, non_block: bool
    ) -> None:
        self.started += 1

    @hookimpl
    def executor_call_finished(
        self,
        backend: str,
        method: str,
        call_id: int,
        duration_s: float,
        error: BaseException | None,
    ) -> None:
        self.finished += 1


@dataclass(frozen=True)
class Overhead:
    """µs per call of each way of calling (the median over rounds of each round's mean)."""

    us_per_call: dict[str, float]
    calls: int
    rounds: int
    #: Each round's mean µs per call, by way, in round order.
    rounds_us: dict[str, list[float]]

    def over_direct(self) -> dict[str, float]:
        """µs per call over the direct method call, for every way but the direct one."""
        direct = self.us_per_call["direct"]
        return {k: v - direct for k, v in self.us_per_call.items() if k != "direct"}

    def over_direct_estimate(self, way: str) -> Estimate:
        """``way``'s µs per call over the direct call's, round by round: their median, with
        its bootstrap interval."""
        return difference_estimate(self.rounds_us[way], self.rounds_us["direct"])


def _mean_us(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def per_call_us(
    fn: Callable[[], Any], calls: int, rounds: int, between: Callable[[], Any] | None = None
) -> float:
    """The median over ``rounds`` rounds of the mean µs per call of ``calls`` calls of
    ``fn`` (``between`` runs after each round, untimed)."""
    results = []
    for _ in range(rounds):
        results.append(_mean_us(fn, calls))
        if between is not None:
            between()
    return statistics.median(results)


def import_ms(statement: str, repeats: int, before: str = "") -> float:
    """The median ms ``statement`` takes in ``repeats`` fresh interpreters (after ``before``,
    untimed)."""
    code = f"{before}\nimport time\nt = time.perf_counter()\n{statement}\n"
    code += "print((time.perf_counter() - t) * 1e3)"
    run = [sys.executable, "-c", code]
    return statistics.median(
        float(subprocess.run(run, capture_output=True, text=True, check=True).stdout)
        for _ in range(repeats)
    )


def measure_imports(repeats: int = 9) -> dict[str, float]:
    """ms of each of :data:`IMPORTS`, the median of ``repeats`` fresh interpreters."""
    return {label: import_ms(statement, repeats) for label, statement in IMPORTS.items()}


def measure_overhead(calls: int = 20_000, rounds: int = 7) -> Overhead:
    """Time each way of calling for ``calls`` calls in each of ``rounds`` rounds (a
    ``non_block`` call, a thread hop, for a quarter as many)."""
    config = ExecutorConfig(backend="uni", worker_cls=BenchWorker)
    registries = [Registry.from_entry_points(allow=["uniproc"]) for _ in range(3)]
    observer, call_observer = RpcObserver(), CallObserver()
    registries[1].register_plugin(observer, "bench-observer")
    registries[2].register_plugin(call_observer, "bench-call-observer")
    with (
        create_executor(config, registries[0]) as plain,
        create_executor(config, registries[1]) as observed,
        create_executor(config, registries[2]) as driver_observed,
    ):
        # uni runs the worker in this process: a callable given the worker returns it as is.
        worker: BenchWorker = plain.collective_rpc(lambda w: w)[0]
        ways: dict[str, tuple[Callable[[], Any], int]] = {
            "direct": (worker.noop, calls),
            "collective_rpc": (lambda: plain.collective_rpc("noop"), calls),
            "callable collective_rpc": (lambda: plain.collective_rpc(BenchWorker.noop), calls),
            "execute_model": (lambda: plain.execute_model(None), calls),
            "non_block collective_rpc + result()": (
                lambda: plain.collective_rpc("noop", non_block=True).result(),
                max(1, calls // 4),
            ),
            "observed collective_rpc": (lambda: observed.collective_rpc("noop"), calls),
            "observed execute_model": (lambda: observed.execute_model(None), calls),
            "driver-observed collective_rpc": (
                lambda: driver_observed.collective_rpc("noop"),
                calls,
            ),
        }
        samples: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(rounds):
            for name, (fn, n) in ways.items():
                samples[name].append(_mean_us(fn, n))
    if observer.seen < 2 * calls * rounds or call_observer.finished < calls * rounds:
        raise RuntimeError("an observer saw fewer calls than were made")
    return Overhead(
        {name: statistics.median(values) for name, values in samples.items()},
        calls,
        rounds,
        samples,
    )
