"""Observability overhead per call: the driver-side hooks and the otel plugin
(executor-plugin-otel: Prometheus metrics, OpenTelemetry spans) on the uni backend, against a
direct method call and the plain call, in one process.

    .venv/bin/python benchmarks/bench_observability.py [--calls 20000] [--rounds 7] [--repeats 9]

Rows, each for `collective_rpc("noop")` and `execute_model(batch)`:

- no plugin (only the uniproc plugin loaded): the core's cost when nobody observes calls;
- a no-op driver-side call observer: the core's cost of calling the two per-call hooks;
- the otel plugin, metrics only (`EXECUTOR_OTEL_TRACES=0`);
- the otel plugin, metrics and spans on, the application not using OpenTelemetry;
- the same with `opentelemetry.trace` imported and no TracerProvider set (the API's no-op);
- the same with the SDK: a TracerProvider with a SimpleSpanProcessor into an
  InMemorySpanExporter (emptied between rounds, outside the timing), so every call records a
  driver span and a worker span.

The median over rounds of the mean per call. Also: the import time of the plugin module in a
fresh interpreter, alone and after what the registry has imported already (what every
`executor` start and every worker process pays).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from typing import Any

from bench_core import NoopWorker, per_call_us  # the same worker and timing as bench_core

from executor_core import ExecutorConfig, create_executor, hookimpl
from executor_core._registry import Registry


class NoopCallObserver:
    """A driver-side observer that does nothing: what the core's hooks cost by themselves."""

    @hookimpl
    def executor_call_started(
        self, backend: str, method: str, call_id: int, world_size: int, non_block: bool
    ) -> None:
        return None

    @hookimpl
    def executor_call_finished(
        self,
        backend: str,
        method: str,
        call_id: int,
        duration_s: float,
        error: BaseException | None,
    ) -> None:
        return None


def import_ms(statement: str, before: str, repeats: int) -> float:
    code = (
        f"{before}\nimport time\nt = time.perf_counter()\n{statement}\n"
        "print((time.perf_counter() - t) * 1e3)"
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=9, help="fresh interpreters per import")
    args = parser.parse_args()
    calls, rounds = args.calls, args.rounds
    sdk_calls = max(1, calls // 4)  # every call keeps two spans until the round ends

    from prometheus_client import CollectorRegistry

    import executor_plugin_otel

    config = ExecutorConfig(backend="uni", worker_cls=NoopWorker)
    rows: list[tuple[str, float, float]] = []

    def measure(label: str, registry: Registry, n: int = calls, between: Any = None) -> None:
        with create_executor(config, registry) as executor:
            rpc = per_call_us(lambda: executor.collective_rpc("noop"), n, rounds, between)
            model = per_call_us(lambda: executor.execute_model(1), n, rounds, between)
        rows.append((label, rpc, model))

    plain = Registry.from_entry_points(allow=["uniproc"])
    with create_executor(config, plain) as executor:
        worker = executor.transport._wrapper.worker  # type: ignore[attr-defined]
        assert isinstance(worker, NoopWorker)
        direct = per_call_us(worker.noop, calls, rounds)
        direct_model = per_call_us(lambda: worker.execute_model(1), calls, rounds)
    rows.append(("direct method call (baseline)", direct, direct_model))
    measure("(a) no plugin", plain)

    noop = Registry.from_entry_points(allow=["uniproc"])
    noop.register_plugin(NoopCallObserver(), "noop-call-observer")
    measure("no-op driver-side call observer (the hooks' own cost)", noop)

    otel = Registry.from_entry_points(allow=["uniproc", "otel"])
    assert "otel" in otel.plugins, "install it: pip install -e ./plugins/otel"
    metrics = CollectorRegistry()

    executor_plugin_otel.configure(registry=metrics, traces=False)
    measure("otel plugin, metrics only (EXECUTOR_OTEL_TRACES=0)", otel)

    assert "opentelemetry.trace" not in sys.modules
    executor_plugin_otel.configure(registry=metrics)
    measure("(b) otel plugin, metrics + traces, OpenTelemetry unused", otel)

    from opentelemetry import trace

    executor_plugin_otel.configure(registry=metrics)
    measure("(b) otel plugin, metrics + traces, OTel API, no provider (no-op)", otel)

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    executor_plugin_otel.configure(registry=metrics)
    measure(
        "(c) otel plugin, metrics + traces, SDK + in-memory exporter",
        otel,
        sdk_calls,
        exporter.clear,
    )
    executor_plugin_otel.configure(registry=metrics, metrics=False)
    measure("otel plugin, traces only, SDK + in-memory exporter", otel, sdk_calls, exporter.clear)

    recorded = metrics.get_sample_value(
        "executor_call_duration_seconds_count", {"backend": "uni", "method": "noop"}
    )
    assert recorded, "the plugin recorded no call"

    print(f"## observability overhead on uni ({calls} calls x {rounds} rounds, median)\n")
    print(f"SDK rows: {sdk_calls} calls per round.\n")
    print(
        '| setup | `collective_rpc("noop")` µs | overhead µs | `execute_model(batch)` µs '
        "| overhead µs |\n|---|---|---|---|---|"
    )
    base_rpc, base_model = rows[1][1], rows[1][2]
    for label, rpc, model in rows:
        print(
            f"| {label} | {rpc:.2f} | {rpc - base_rpc:+.2f} | {model:.2f} | "
            f"{model - base_model:+.2f} |"
        )
    python = sys.version.split()[0]
    print(f"\nOverhead: against (a), the plain call without observers. Python {python}.")

    print(f"\n## import time (fresh interpreter, median of {args.repeats})\n")
    print("| what | ms |\n|---|---|")
    registry_imports = "import executor_core._registry, executor_plugin_uniproc"
    for label, statement, before in [
        ("`import executor_plugin_otel` alone", "import executor_plugin_otel", ""),
        (
            "`import executor_plugin_otel` after the registry's imports",
            "import executor_plugin_otel",
            registry_imports,
        ),
        ("baseline: `import prometheus_client`", "import prometheus_client", ""),
        ("baseline: `import opentelemetry.trace`", "import opentelemetry.trace", ""),
    ]:
        print(f"| {label} | {import_ms(statement, before, args.repeats):.2f} |")


if __name__ == "__main__":
    main()
