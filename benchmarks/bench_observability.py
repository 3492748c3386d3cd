"""Observability overhead per call: the driver-side hooks and the otel plugin
(executor-plugin-otel: Prometheus metrics, OpenTelemetry spans) on the uni backend, against a
direct method call and the plain call, in one process.

    .venv/bin/python benchmarks/bench_observability.py [--calls 20000] [--rounds 7] [--repeats 9]

Rows, each for `collective_rpc("noop")` and `execute_model(batch)`: no plugin; a driver-side
call observer (`executor bench`'s); the otel plugin with metrics only, with metrics and spans
(OpenTelemetry unused; its API imported, no provider; the SDK with an in-memory exporter,
emptied between rounds), and spans only. Then the plugin module's import time in fresh
interpreters, alone and after the registry's imports. Timing and worker: `executor bench`'s.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from executor_bench import BenchWorker, CallObserver, import_ms, markdown_table, per_call_us
from executor_core import ExecutorConfig, create_executor
from executor_core.backend import Registry


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

    config = ExecutorConfig(backend="uni", worker_cls=BenchWorker)
    rows: list[tuple[str, float, float]] = []

    def measure(label: str, registry: Registry, n: int = calls, between: Any = None) -> None:
        with create_executor(config, registry) as executor:
            rpc = per_call_us(lambda: executor.collective_rpc("noop"), n, rounds, between)
            model = per_call_us(lambda: executor.execute_model(1), n, rounds, between)
        rows.append((label, rpc, model))

    plain = Registry.from_entry_points(allow=["uniproc"])
    with create_executor(config, plain) as executor:
        worker: BenchWorker = executor.collective_rpc(lambda w: w)[0]  # uni: this process's
        direct = per_call_us(worker.noop, calls, rounds)
        direct_model = per_call_us(lambda: worker.execute_model(1), calls, rounds)
    rows.append(("direct method call (baseline)", direct, direct_model))
    measure("(a) no plugin", plain)

    observed = Registry.from_entry_points(allow=["uniproc"])
    observed.register_plugin(CallObserver(), "call-observer")
    measure("driver-side call observer (the hooks' own cost)", observed)

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
    sdk = "otel plugin, {}, SDK + in-memory exporter"
    measure("(c) " + sdk.format("metrics + traces"), otel, sdk_calls, exporter.clear)
    executor_plugin_otel.configure(registry=metrics, metrics=False)
    measure(sdk.format("traces only"), otel, sdk_calls, exporter.clear)
    recorded = metrics.get_sample_value(
        "executor_call_duration_seconds_count", {"backend": "uni", "method": "noop"}
    )
    assert recorded, "the plugin recorded no call"

    print(f"## observability overhead on uni ({calls} calls x {rounds} rounds, median)\n")
    print(f"SDK rows: {sdk_calls} calls per round. Overhead: against (a), no observer.\n")
    base_rpc, base_model = rows[1][1], rows[1][2]
    header = ["setup", '`collective_rpc("noop")` µs', "overhead µs", "`execute_model` µs"]
    table = [
        (
            label,
            f"{rpc:.2f}",
            f"{rpc - base_rpc:+.2f}",
            f"{model:.2f}",
            f"{model - base_model:+.2f}",
        )
        for label, rpc, model in rows
    ]
    print(markdown_table([*header, "overhead µs"], table))

    print(f"\n## import time (fresh interpreter, median of {args.repeats})\n")
    registry = "from executor_core.backend import Registry\nimport executor_plugin_uniproc"
    imports = [
        ("`import executor_plugin_otel` alone", "import executor_plugin_otel", ""),
        (
            "`import executor_plugin_otel` after the registry's",
            "import executor_plugin_otel",
            registry,
        ),
        ("baseline: `import prometheus_client`", "import prometheus_client", ""),
        ("baseline: `import opentelemetry.trace`", "import opentelemetry.trace", ""),
    ]
    cells = [(label, f"{import_ms(s, args.repeats, before):.2f}") for label, s, before in imports]
    print(markdown_table(["what", "ms"], cells))


if __name__ == "__main__":
    main()
