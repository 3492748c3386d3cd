"""The ``otel`` workload: what the otel plugin (executor-plugin-otel: Prometheus metrics,
OpenTelemetry spans) costs a call on ``uni``, in this process, against the same call with no
plugin; a driver-side observer that does nothing (the hooks' own cost) beside it.

Each set-up's ``collective_rpc("noop")`` and ``execute_model(1)``: the median over rounds of
each round's mean µs per call (``_overhead.per_call_us``). With OpenTelemetry's SDK every call
keeps two spans until its round ends: those rows make a quarter as many calls.
"""

from __future__ import annotations

import sys
from typing import Any

from executor_core import ExecutorConfig, create_executor
from executor_core.backend import Registry

from ._intervals import count
from ._overhead import CallObserver, import_ms, per_call_us
from ._result import Table
from ._selection import not_installed
from ._worker import BenchWorker

__all__ = ["ROUNDS", "measure", "missing"]

#: Rounds when ``--repeats`` is not given.
ROUNDS = 7


def missing() -> str:
    """Why the workload cannot run here; empty if it can."""
    return not_installed("executor_plugin_otel", "executor_plugin_uniproc", "opentelemetry.sdk")


def measure(rounds: int, quick: bool, backends: list[str]) -> list[Table]:
    """The plugin's cost per call in each set-up, over no plugin's."""
    from prometheus_client import CollectorRegistry

    import executor_plugin_otel

    calls = 2_000 if quick else 20_000
    config = ExecutorConfig(backend="uni", worker_cls=BenchWorker)
    timed: dict[str, tuple[float, float]] = {}

    def time_it(label: str, registry: Registry, n: int = calls, between: Any = None) -> None:
        with create_executor(config, registry) as executor:
            rpc = per_call_us(lambda: executor.collective_rpc("noop"), n, rounds, between)
            model = per_call_us(lambda: executor.execute_model(1), n, rounds, between)
        timed[label] = (rpc, model)

    time_it("no plugin", Registry.from_entry_points(allow=["uniproc"]))
    observed = Registry.from_entry_points(allow=["uniproc"])
    observed.register_plugin(CallObserver(), "call-observer")
    time_it("a driver-side call observer (the hooks' own cost)", observed)
    otel = Registry.from_entry_points(allow=["uniproc", "otel"])
    metrics = CollectorRegistry()
    executor_plugin_otel.configure(registry=metrics, traces=False)
    time_it("otel: metrics only (EXECUTOR_OTEL_TRACES=0)", otel)
    executor_plugin_otel.configure(registry=metrics)
    if "opentelemetry.trace" not in sys.modules:  # another workload may have imported it
        time_it("otel: metrics and spans, OpenTelemetry unused", otel)
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    executor_plugin_otel.configure(registry=metrics)
    time_it("otel: metrics and spans, OpenTelemetry's API, no provider", otel)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    executor_plugin_otel.configure(registry=metrics)
    sdk = "otel: {}, the SDK, a SimpleSpanProcessor, an in-memory exporter"
    time_it(sdk.format("metrics and spans"), otel, max(1, calls // 4), exporter.clear)
    executor_plugin_otel.configure(registry=metrics, metrics=False)
    time_it(sdk.format("spans only"), otel, max(1, calls // 4), exporter.clear)
    labels = {"backend": "uni", "method": "noop"}
    if not metrics.get_sample_value("executor_call_duration_seconds_count", labels):
        raise RuntimeError("the otel plugin recorded no call")
    registry = "from executor_core.backend import Registry\nimport executor_plugin_uniproc"
    imports = [import_ms("import executor_plugin_otel", 3, before) for before in ("", registry)]
    table = Table(
        "otel",
        f"uni, {count(rounds, 'round')} of {calls:,} calls (the SDK's rows: {calls // 4:,}), "
        "median; µs per call, and over no plugin's. Importing the plugin: "
        f"{imports[0]:.2f} ms alone, {imports[1]:.2f} ms after the registry's (fresh "
        "interpreters, median of 3).",
        ["set-up", 'collective_rpc("noop") µs', "over", "execute_model µs", "over"],
    )
    base_rpc, base_model = timed["no plugin"]
    for label, (rpc, model) in timed.items():
        table.rows.append(
            [
                label,
                f"{rpc:.2f}",
                f"{rpc - base_rpc:+.2f}",
                f"{model:.2f}",
                f"{model - base_model:+.2f}",
            ]
        )
    return [table]
