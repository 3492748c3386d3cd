"""executor-plugin-otel: installed, it records Prometheus metrics and OpenTelemetry spans for
every call, on uni and mp, through the core's hooks only.

Each test gives the plugin its own CollectorRegistry and TracerProvider (an
InMemorySpanExporter behind a SimpleSpanProcessor) through ``configure``; one test runs the
plain installed set-up (the default registry and the global provider) in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client import CollectorRegistry

import executor_plugin_otel
from executor_core import WorkerDiedError, WorkerError, create_executor
from executor_core.backend import Registry
from executor_core.testing import conformance_config


class Observed:
    """What the plugin recorded in this test."""

    def __init__(self) -> None:
        self.metrics = CollectorRegistry()
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def value(self, name: str, **labels: str) -> float | None:
        return self.metrics.get_sample_value(name, labels)

    def count(self, backend: str, method: str) -> float | None:
        return self.value("executor_call_duration_seconds_count", backend=backend, method=method)

    def spans(self, prefix: str = "executor ") -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if s.name.startswith(prefix)]


@pytest.fixture
def observed() -> Iterator[Observed]:
    record = Observed()
    executor_plugin_otel.configure(registry=record.metrics, tracer_provider=record.provider)
    yield record
    executor_plugin_otel.configure()  # back to the defaults (the environment's)
    record.provider.shutdown()


def _attr(span: ReadableSpan, name: str) -> Any:
    return (span.attributes or {})[name]


def _registry(backend_plugin: str) -> Registry:
    return Registry.from_entry_points(allow=[backend_plugin, "otel"])


def test_the_plugin_is_installed_and_implements_the_hooks() -> None:
    registry = Registry.from_entry_points()
    assert registry.plugins["otel"] == ("executor-plugin-otel", executor_plugin_otel.__version__)
    assert not [b for b in registry.broken if b.name == "otel"]


def test_uni_metrics(observed: Observed) -> None:
    with create_executor(conformance_config("uni"), _registry("uniproc")) as executor:
        for _ in range(5):
            executor.collective_rpc("get_rank")
        for step in range(3):
            executor.execute_model(step)
        executor.collective_rpc("echo", non_block=True).result(5)
        with pytest.raises(WorkerError):
            executor.collective_rpc("fail", args=("on purpose",))
        assert observed.value("executor_calls_in_flight", backend="uni") == 0
        executor.sleep()
        assert observed.value("executor_sleeping", backend="uni") == 1
        executor.wake_up(["weights"])
        assert observed.value("executor_sleeping", backend="uni") == 1
        executor.wake_up()
        assert observed.value("executor_sleeping", backend="uni") == 0
    assert observed.count("uni", "get_rank") == 5
    assert observed.count("uni", "execute_model") == 3
    assert observed.count("uni", "echo") == 1
    assert observed.count("uni", "fail") == 1
    assert observed.count("uni", "sleep") == 1
    assert observed.count("uni", "wake_up") == 2
    assert observed.value("executor_calls_in_flight", backend="uni") == 0
    errors = "executor_call_errors_total"
    assert observed.value(errors, backend="uni", method="fail", error="WorkerError") == 1
    assert observed.value(errors, backend="uni", method="get_rank", error="WorkerError") is None
    buckets = observed.value(
        "executor_call_duration_seconds_bucket", backend="uni", method="get_rank", le="+Inf"
    )
    assert buckets == 5
    total = observed.value("executor_call_duration_seconds_sum", backend="uni", method="get_rank")
    assert total is not None
    assert 0 < total < 5


def test_uni_spans_driver_and_worker_child(observed: Observed) -> None:
    with create_executor(conformance_config("uni"), _registry("uniproc")) as executor:
        executor.collective_rpc("get_rank")
        with pytest.raises(WorkerError):
            executor.collective_rpc("fail", args=("on purpose",))
    driver = {_attr(s, "executor.method"): s for s in observed.spans("executor ")}
    worker = {_attr(s, "executor.method"): s for s in observed.spans("executor.worker ")}
    assert set(driver) == set(worker) == {"get_rank", "fail"}
    call = driver["get_rank"]
    assert call.name == "executor get_rank"
    assert call.kind == trace.SpanKind.CLIENT
    attributes = dict(call.attributes or {})
    assert attributes["executor.backend"] == "uni"
    assert attributes["executor.world_size"] == 1
    assert attributes["executor.non_block"] is False
    assert isinstance(attributes["executor.call_id"], int)
    assert call.status.status_code == StatusCode.UNSET
    # In-process worker, a blocking call: the worker's span is a child of the call's.
    rank = worker["get_rank"]
    assert rank.parent is not None
    assert rank.parent.span_id == call.context.span_id
    assert rank.context.trace_id == call.context.trace_id
    assert rank.attributes is not None
    assert rank.attributes["executor.rank"] == 0
    assert rank.start_time is not None
    assert call.start_time is not None
    assert rank.start_time >= call.start_time
    # The failing call: the error on both spans.
    failed = driver["fail"]
    assert failed.status.status_code == StatusCode.ERROR
    assert failed.attributes is not None
    assert failed.attributes["error.type"] == "WorkerError"
    assert [e.name for e in failed.events] == ["exception"]
    assert worker["fail"].status.status_code == StatusCode.ERROR
    assert worker["fail"].attributes is not None
    assert worker["fail"].attributes["error.type"] == "ValueError"
    # Every call id is its own.
    ids = {s.attributes["executor.call_id"] for s in driver.values() if s.attributes}
    assert len(ids) == 2


def test_non_block_calls_leave_no_current_span(observed: Observed) -> None:
    with create_executor(conformance_config("uni"), _registry("uniproc")) as executor:
        future = executor.collective_rpc("slow", args=(0.05,), non_block=True)
        assert not trace.get_current_span().get_span_context().is_valid
        future.result(5)
        executor.collective_rpc("get_rank")
        assert not trace.get_current_span().get_span_context().is_valid
    (span,) = [s for s in observed.spans("executor ") if s.name == "executor slow"]
    assert span.attributes is not None
    assert span.attributes["executor.non_block"] is True
    assert span.end_time is not None


def test_switches_turn_metrics_and_spans_off(observed: Observed) -> None:
    executor_plugin_otel.configure(
        metrics=False, traces=False, registry=observed.metrics, tracer_provider=observed.provider
    )
    with create_executor(conformance_config("uni"), _registry("uniproc")) as executor:
        executor.collective_rpc("get_rank")
    assert observed.count("uni", "get_rank") is None
    assert observed.exporter.get_finished_spans() == ()


def test_environment_switches(monkeypatch: pytest.MonkeyPatch, observed: Observed) -> None:
    monkeypatch.setenv(executor_plugin_otel._TRACES_ENV_VAR, "0")
    executor_plugin_otel.configure(registry=observed.metrics, tracer_provider=observed.provider)
    with create_executor(conformance_config("uni"), _registry("uniproc")) as executor:
        executor.collective_rpc("get_rank")
    assert observed.count("uni", "get_rank") == 1
    assert observed.exporter.get_finished_spans() == ()


def _wait_for(predicate: Any, timeout: float = 5.0) -> None:
    give_up = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < give_up, "timed out"
        time.sleep(0.01)


def test_mp_metrics_spans_and_a_killed_worker(observed: Observed, tmp_path: Path) -> None:
    pytest.importorskip("executor_plugin_multiproc")
    spans_file = tmp_path / "worker-spans.jsonl"
    config = conformance_config(
        "mp",
        world_size=2,
        worker_cls="otel_test_workers:SpanFileWorker",
        env={"EXECUTOR_OTEL_TEST_SPANS": str(spans_file)},
        backend_options={"shutdown_grace_s": 1.0},
    )
    with create_executor(config, _registry("multiproc")) as executor:
        pids = executor.collective_rpc("get_pid")
        for _ in range(3):
            executor.collective_rpc("get_rank")
        executor.execute_model("batch")
        with pytest.raises(WorkerError):
            executor.collective_rpc("fail", args=("on purpose",), kwargs={"on_rank": 1})
        assert observed.value("executor_calls_in_flight", backend="mp") == 0
        pending = executor.collective_rpc("slow", args=(30.0,), non_block=True)
        _wait_for(lambda: observed.value("executor_calls_in_flight", backend="mp") == 1)
        time.sleep(0.2)
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(WorkerDiedError):
            pending.result(5)
        _wait_for(lambda: observed.value("executor_worker_deaths_total", backend="mp") == 1)
    assert observed.count("mp", "get_rank") == 3
    assert observed.count("mp", "execute_model") == 1
    assert observed.value("executor_calls_in_flight", backend="mp") == 0
    errors = "executor_call_errors_total"
    assert observed.value(errors, backend="mp", method="fail", error="WorkerError") == 1
    assert observed.value(errors, backend="mp", method="slow", error="WorkerDiedError") == 1
    driver = observed.spans("executor ")
    calls = [s for s in driver if s.name != "executor worker_died"]
    assert [s.attributes["executor.method"] for s in calls if s.attributes] == [
        "get_pid",
        "get_rank",
        "get_rank",
        "get_rank",
        "execute_model",
        "fail",
        "slow",
    ]
    assert all(s.attributes and s.attributes["executor.world_size"] == 2 for s in calls)
    assert calls[-1].status.status_code == StatusCode.ERROR
    (death,) = [s for s in driver if s.name == "executor worker_died"]
    assert death.attributes is not None
    assert death.attributes["executor.ranks"] == (0,)
    # The workers' own spans, one per rank and call, recorded in the worker processes.
    records = [json.loads(line) for line in spans_file.read_text().splitlines()]
    assert {r["pid"] for r in records} == set(pids)
    for rank in (0, 1):
        mine = [r for r in records if r["attributes"]["executor.rank"] == rank]
        methods = [r["attributes"]["executor.method"] for r in mine]
        assert methods.count("get_rank") == 3
        assert "execute_model" in methods
        assert all(r["attributes"]["executor.backend"] == "mp" for r in mine)
        assert all(r["parent"] is None for r in mine)  # no trace context over the wire
    failing = [r for r in records if r["attributes"]["executor.method"] == "fail"]
    assert {r["attributes"]["executor.rank"]: r["status"] for r in failing} == {
        0: "UNSET",
        1: "ERROR",
    }


def test_recoveries_are_counted_with_their_duration(observed: Observed) -> None:
    pytest.importorskip("executor_plugin_multiproc")
    from executor_core import ExecutorState, RecoveryPolicy

    config = conformance_config(
        "mp",
        world_size=2,
        recovery=RecoveryPolicy(backoff_s=0.1),
        backend_options={"shutdown_grace_s": 1.0},
    )
    with create_executor(config, _registry("multiproc")) as executor:
        pids = executor.collective_rpc("get_pid")
        os.kill(pids[1], signal.SIGKILL)
        _wait_for(lambda: observed.value("executor_worker_deaths_total", backend="mp") == 1)
        _wait_for(lambda: executor.state is ExecutorState.RUNNING, timeout=30)
        _wait_for(lambda: observed.value("executor_recoveries_total", backend="mp") == 1)
        assert executor.collective_rpc("get_rank") == [0, 1]
    count = observed.value("executor_recovery_duration_seconds_count", backend="mp")
    assert count == 1
    took = observed.value("executor_recovery_duration_seconds_sum", backend="mp")
    assert took is not None
    assert 0 < took < 30


INSTALLED = """
import json
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from executor_core import create_executor
from executor_core.testing import conformance_config

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)

with create_executor(conformance_config("uni")) as executor:  # the default registry
    for _ in range(4):
        executor.collective_rpc("get_rank")
count = REGISTRY.get_sample_value(
    "executor_call_duration_seconds_count", {"backend": "uni", "method": "get_rank"}
)
print(json.dumps({"count": count, "spans": [s.name for s in exporter.get_finished_spans()]}))
"""


def test_installed_plugin_exports_to_the_default_registry_and_global_provider() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXECUTOR_")}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(INSTALLED)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=env,
    )
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["count"] == 4
    assert result["spans"].count("executor get_rank") == 4
    assert result["spans"].count("executor.worker get_rank") == 4


def test_importing_the_plugin_imports_neither_prometheus_nor_opentelemetry() -> None:
    probe = (
        "import executor_plugin_otel, sys, json\n"
        "print(json.dumps(sorted(m for m in sys.modules "
        "if m.startswith(('prometheus_client', 'opentelemetry')))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(done.stdout) == []
