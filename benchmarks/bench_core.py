"""Core benchmark: the cost of `import executor_core`, and the uniproc overhead over a direct call.

    .venv/bin/python benchmarks/bench_core.py [--repeats 15] [--calls 20000]

Import times are measured in fresh interpreters (the median of --repeats runs), side by side
with importing attrs and pluggy alone. The uniproc overhead compares, in one process, a direct
method call on a worker against the same call through `collective_rpc` and `execute_model`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from executor_core import ExecutorConfig, WorkerBase, WorkerContext, create_executor, hookimpl

try:  # the registry moved out of the users' names; the old import keeps baseline runs working
    from executor_core._registry import Registry
except ImportError:  # pragma: no cover
    from executor_core import Registry

IMPORTS = {
    "import executor_core": "import executor_core",
    "users' API (Executor, ExecutorConfig, hookimpl, create_executor)": (
        "from executor_core import Executor, ExecutorConfig, hookimpl, create_executor"
    ),
    "baseline: import attrs": "import attrs",
    "baseline: import pluggy": "import pluggy",
}


def import_ms(statement: str, repeats: int) -> float:
    code = (
        f"import time\nt = time.perf_counter()\n{statement}\nprint((time.perf_counter() - t) * 1e3)"
    )
    samples = [
        float(
            subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, check=True
            ).stdout
        )
        for _ in range(repeats)
    ]
    return statistics.median(samples)


class NoopWorker(WorkerBase):
    def noop(self) -> None:
        return None

    def execute_model(self, batch: object) -> object:
        return batch


class RpcObserver:
    """A minimal observer plugin: counts the RPCs it sees."""

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


def per_call_us(
    fn: Callable[[], object],
    calls: int,
    rounds: int = 7,
    between: Callable[[], None] | None = None,
) -> float:
    """Median over rounds of the mean time per call, in microseconds (``between`` runs after
    each round, untimed)."""
    results = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        results.append((time.perf_counter() - start) / calls * 1e6)
        if between is not None:
            between()
    return statistics.median(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()

    print("## import time (fresh interpreter, median of", args.repeats, "runs)\n")
    print("| what | ms |\n|---|---|")
    for label, statement in IMPORTS.items():
        print(f"| {label} | {import_ms(statement, args.repeats):.1f} |")

    config = ExecutorConfig(backend="uni", worker_cls=NoopWorker)
    # Only the uniproc plugin: what a user without observer plugins runs.
    registry = Registry.from_entry_points(allow=["uniproc"])
    with create_executor(config, registry) as executor:
        # The worker object itself (before and after the transport split of the executor).
        owner = getattr(executor, "_wrapper", None) or getattr(executor, "transport", None)
        owner = getattr(owner, "_wrapper", owner)
        worker = owner.worker  # type: ignore[union-attr]
        assert isinstance(worker, NoopWorker)
        direct = per_call_us(worker.noop, args.calls)
        rpc = per_call_us(lambda: executor.collective_rpc("noop"), args.calls)
        model = per_call_us(lambda: executor.execute_model(1), args.calls)
        callable_rpc = per_call_us(lambda: executor.collective_rpc(NoopWorker.noop), args.calls)
        non_block = per_call_us(
            lambda: executor.collective_rpc("noop", non_block=True).result(), args.calls // 4
        )
        registry.register_plugin(RpcObserver(), "bench-observer")
        observed = per_call_us(lambda: executor.collective_rpc("noop"), args.calls)
        observed_model = per_call_us(lambda: executor.execute_model(1), args.calls)
        # The driver-side observer alone (the worker-side one removed); "n/a" on a core
        # without the driver-side hooks (before_after.sh runs old revisions).
        registry.plugin_manager.unregister(name="bench-observer")
        driver_observed: float | None = None
        if registry.register_plugin(CallObserver(), "bench-call-observer"):
            driver_observed = per_call_us(lambda: executor.collective_rpc("noop"), args.calls)
    print(f"\n## uniproc overhead ({args.calls} calls x 7 rounds, median)\n")
    print("| call | µs/call | overhead µs | ratio to direct |\n|---|---|---|---|")
    for label, value in [
        ("direct `worker.noop()` (baseline)", direct),
        ('`collective_rpc("noop")`', rpc),
        ("`collective_rpc(NoopWorker.noop)` (callable)", callable_rpc),
        ("`execute_model(batch)`", model),
        ("`collective_rpc(..., non_block=True).result()` (thread hop)", non_block),
        ('`collective_rpc("noop")` with an RPC observer plugin', observed),
        ("`execute_model(batch)` with an RPC observer plugin", observed_model),
        ('`collective_rpc("noop")` with a driver-side call observer plugin', driver_observed),
    ]:
        if value is None:
            print(f"| {label} | n/a | n/a | n/a |")
            continue
        print(f"| {label} | {value:.2f} | {value - direct:.2f} | {value / direct:.1f}x |")


if __name__ == "__main__":
    main()
