"""executor-plugin-otel: Prometheus metrics and OpenTelemetry spans for every executor call.

This module is the plugin the registry imports (in the driver and in every worker process):
it only declares hook implementations. prometheus_client is imported on the first observed
call in the driver, OpenTelemetry only once spans have somewhere to go (a provider given to
:func:`configure`, or a global ``TracerProvider`` the application set), so importing this
module costs next to nothing.

Metrics (driver, ``prometheus_client``): ``executor_call_duration_seconds{backend,method}``,
``executor_calls_in_flight{backend}``, ``executor_call_errors_total{backend,method,error}``,
``executor_worker_deaths_total{backend}``, ``executor_sleeping{backend}``.

Spans: one per call in the driver (the current span while a blocking call runs), and one per
rank and call in each worker process. Configure with ``EXECUTOR_OTEL_METRICS`` and
``EXECUTOR_OTEL_TRACES`` (``0`` turns one off), or :func:`configure`.
"""

from __future__ import annotations

import os
import sys
import time

from executor_core import hookimpl

# Not typing.TYPE_CHECKING (importing typing costs time here); type checkers treat any
# constant of this name as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from contextvars import Token
    from types import ModuleType
    from typing import Any

    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer, TracerProvider
    from prometheus_client import CollectorRegistry

    from executor_core import WorkerContext, WorkerDiedError

    from ._metrics import Metrics

__all__ = [
    "__version__",
    "configure",
    "executor_call_finished",
    "executor_call_started",
    "executor_recovered",
    "executor_sleep_changed",
    "executor_worker_died",
    "executor_worker_rpc_finished",
]

__version__ = "0.1.0"  # the one source of the distribution's version (pyproject reads it)

#: ``0`` (or ``false``, ``no``, ``off``) turns the Prometheus metrics, or the spans, off.
_METRICS_ENV_VAR, _TRACES_ENV_VAR = "EXECUTOR_OTEL_METRICS", "EXECUTOR_OTEL_TRACES"
#: OpenTelemetry's variable naming a provider to load on first use.
_PROVIDER_ENV_VAR = "OTEL_PYTHON_TRACER_PROVIDER"
#: The instrumentation scope of the spans.
_TRACER_NAME = "executor_plugin_otel"


def _enabled(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


class _Plugin:
    """What the hooks use in this process; built on the first hook call (or by configure)."""

    def __init__(
        self,
        metrics: bool,
        traces: bool,
        registry: CollectorRegistry | None,
        tracer_provider: TracerProvider | None,
    ) -> None:
        self._metrics_on, self._traces_on = metrics, traces
        self._registry, self._provider = registry, tracer_provider
        self._env_provider = _PROVIDER_ENV_VAR in os.environ
        #: Built by the first driver-side hook (worker processes never import prometheus).
        self.metrics: Metrics | None = None
        #: Taken once spans have somewhere to go, with opentelemetry.context and .trace.
        self.tracer: Tracer | None = None
        self.context: ModuleType
        self.trace: ModuleType
        #: Driver spans of calls in flight, by call id, with the context token of a blocking
        #: call's span (made current in the caller's thread until the call finishes).
        self.spans: dict[int, tuple[Span, Token[Context] | None]] = {}

    def load_metrics(self) -> Metrics | None:
        if not self._metrics_on:
            return None
        from ._metrics import metrics_for

        self.metrics = metrics = metrics_for(self._registry)
        return metrics

    def load_tracer(self) -> Tracer | None:
        """The tracer, or None while spans are off or nothing would receive them."""
        if not self._traces_on:
            return None
        provider = self._provider
        if provider is None:
            api = sys.modules.get("opentelemetry.trace")
            if api is None:  # the application does not use OpenTelemetry
                return None
            # No global provider yet: the API's own variable, read without its os.environ
            # look-up (a few hundred ns per call); where it is not there, ask the API.
            if getattr(api, "_TRACER_PROVIDER", False) is None and not self._env_provider:
                return None
            provider = api.get_tracer_provider()
            if isinstance(provider, api.ProxyTracerProvider):  # no provider set (yet)
                return None
        from opentelemetry import context, trace

        self.context, self.trace = context, trace
        self.tracer = tracer = provider.get_tracer(_TRACER_NAME, __version__)
        return tracer


_plugin: _Plugin | None = None


def _start() -> _Plugin:
    global _plugin
    _plugin = _Plugin(_enabled(_METRICS_ENV_VAR), _enabled(_TRACES_ENV_VAR), None, None)
    return _plugin


def configure(
    *,
    metrics: bool | None = None,
    traces: bool | None = None,
    registry: CollectorRegistry | None = None,
    tracer_provider: TracerProvider | None = None,
) -> None:
    """Set up (again) what this process exports; calls in flight then may be missed.

    ``metrics`` and ``traces`` default to the environment (``EXECUTOR_OTEL_METRICS``,
    ``EXECUTOR_OTEL_TRACES``; on unless ``0``); ``registry`` to ``prometheus_client.REGISTRY``;
    ``tracer_provider`` to the global one, as soon as the application sets one.
    """
    global _plugin
    _plugin = _Plugin(
        _enabled(_METRICS_ENV_VAR) if metrics is None else metrics,
        _enabled(_TRACES_ENV_VAR) if traces is None else traces,
        registry,
        tracer_provider,
    )


def _record_error(span: Span, error: BaseException) -> None:
    from opentelemetry.trace import Status, StatusCode

    kind = type(error).__qualname__
    span.set_attribute("error.type", kind)
    span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, f"{kind}: {error}"))


# --- driver side -----------------------------------------------------------------------------


@hookimpl
def executor_call_started(
    backend: str, method: str, call_id: int, world_size: int, non_block: bool
) -> None:
    """Count the call in flight; start its span."""
    plugin = _plugin or _start()
    metrics = plugin.metrics or plugin.load_metrics()
    if metrics is not None:
        metrics.started(backend)
    tracer = plugin.tracer or plugin.load_tracer()
    if tracer is None:
        return
    trace = plugin.trace
    span = tracer.start_span(
        f"executor {method}",
        kind=trace.SpanKind.CLIENT,
        attributes={
            "executor.backend": backend,
            "executor.method": method,
            "executor.call_id": call_id,
            "executor.world_size": world_size,
            "executor.non_block": non_block,
        },
    )
    token = None
    if not non_block:  # finished in this thread: the span is current until then
        token = plugin.context.attach(trace.set_span_in_context(span))
    plugin.spans[call_id] = (span, token)


@hookimpl
def executor_call_finished(
    backend: str, method: str, call_id: int, duration_s: float, error: BaseException | None
) -> None:
    """Record the call's duration (and error); end its span."""
    plugin = _plugin or _start()
    metrics = plugin.metrics or plugin.load_metrics()
    if metrics is not None:
        metrics.finished(backend, method, duration_s, error)
    entry = plugin.spans.pop(call_id, None)
    if entry is None:  # started while spans had nowhere to go
        return
    span, token = entry
    if token is not None:
        plugin.context.detach(token)
    if error is not None:
        _record_error(span, error)
    span.end()


@hookimpl
def executor_worker_died(
    backend: str, ranks: tuple[int, ...], node: str | None, error: WorkerDiedError
) -> None:
    """Count the workers lost; a zero-length span says so."""
    plugin = _plugin or _start()
    metrics = plugin.metrics or plugin.load_metrics()
    if metrics is not None:
        metrics.died(backend, len(ranks))
    tracer = plugin.tracer or plugin.load_tracer()
    if tracer is not None:
        attributes: dict[str, Any] = {"executor.backend": backend, "executor.ranks": list(ranks)}
        if node is not None:
            attributes["executor.node"] = node
        span = tracer.start_span("executor worker_died", attributes=attributes)
        _record_error(span, error)
        span.end()


@hookimpl
def executor_recovered(backend: str, ranks: tuple[int, ...], duration_s: float) -> None:
    """Count the recovery and its duration (the deaths are counted as they happen)."""
    plugin = _plugin or _start()
    metrics = plugin.metrics or plugin.load_metrics()
    if metrics is not None:
        metrics.recovered(backend, duration_s)


@hookimpl
def executor_sleep_changed(backend: str, sleeping: bool, tags: frozenset[str]) -> None:
    """Set the sleeping gauge."""
    plugin = _plugin or _start()
    metrics = plugin.metrics or plugin.load_metrics()
    if metrics is not None:
        metrics.sleep_changed(backend, sleeping)


# --- worker side -----------------------------------------------------------------------------


@hookimpl
def executor_worker_rpc_finished(
    context: WorkerContext, method: str, duration_s: float, error: BaseException | None
) -> None:
    """A span for this rank's part of the call (in the worker's process)."""
    plugin = _plugin or _start()
    tracer = plugin.tracer or plugin.load_tracer()
    if tracer is None:
        return
    end = time.time_ns()
    span = tracer.start_span(
        f"executor.worker {method}",
        start_time=end - int(duration_s * 1e9),
        attributes={
            "executor.backend": context.backend,
            "executor.method": method,
            "executor.rank": context.rank,
            "executor.local_rank": context.local_rank,
            "executor.world_size": context.world_size,
            "executor.node_id": context.node_id,
        },
    )
    if error is not None:
        _record_error(span, error)
    span.end(end_time=end)
