"""executor-plugin-otel: Prometheus metrics and OpenTelemetry spans for every executor call.

This module is the plugin the registry imports (in the driver and in every worker process):
it only declares hook implementations. prometheus_client is imported on the first observed
call in the driver, OpenTelemetry only if the application uses it (see :mod:`._traces`), so
importing this module costs next to nothing.

Metrics (driver, ``prometheus_client``): ``executor_call_duration_seconds{backend,method}``,
``executor_calls_in_flight{backend}``, ``executor_call_errors_total{backend,method,error}``,
``executor_worker_deaths_total{backend}``, ``executor_sleeping{backend}``.

Spans (OpenTelemetry, through the global ``TracerProvider`` or the one given to
:func:`configure`): one per call in the driver, and one per rank and call in each worker
process. Configure with ``EXECUTOR_OTEL_METRICS`` and ``EXECUTOR_OTEL_TRACES`` (``0`` turns
one off), or :func:`configure`.
"""

from __future__ import annotations

import os

from executor_core import hookimpl

# Not typing.TYPE_CHECKING (importing typing costs time here); type checkers treat any
# constant of this name as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider
    from prometheus_client import CollectorRegistry

    from executor_core import WorkerContext, WorkerDiedError

    from ._metrics import Metrics
    from ._traces import Traces

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

#: ``0`` (or ``false``, ``no``, ``off``) turns the Prometheus metrics off.
_METRICS_ENV_VAR = "EXECUTOR_OTEL_METRICS"
#: ``0`` (or ``false``, ``no``, ``off``) turns the OpenTelemetry spans off.
_TRACES_ENV_VAR = "EXECUTOR_OTEL_TRACES"

_OFF = ("0", "false", "no", "off")


def _enabled(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in _OFF


class _Plugin:
    """What the hooks use in this process; built on the first hook call (or by configure)."""

    __slots__ = ("_metrics_on", "_registry", "metrics", "traces")

    def __init__(
        self,
        metrics: bool,
        traces: bool,
        registry: CollectorRegistry | None,
        tracer_provider: TracerProvider | None,
    ) -> None:
        self._metrics_on = metrics
        self._registry = registry
        #: Built by the first driver-side hook (worker processes never import prometheus).
        self.metrics: Metrics | None = None
        self.traces: Traces | None = None
        if traces:
            from ._traces import Traces  # light: OpenTelemetry is imported only when used

            self.traces = Traces(tracer_provider, __version__)

    def load_metrics(self) -> Metrics | None:
        if not self._metrics_on:
            return None
        from ._metrics import metrics_for

        self.metrics = metrics = metrics_for(self._registry)
        return metrics


_plugin: _Plugin | None = None


def _start() -> _Plugin:
    global _plugin
    plugin = _plugin
    if plugin is None:
        plugin = _plugin = _Plugin(
            _enabled(_METRICS_ENV_VAR), _enabled(_TRACES_ENV_VAR), None, None
        )
    return plugin


def configure(
    *,
    metrics: bool | None = None,
    traces: bool | None = None,
    registry: CollectorRegistry | None = None,
    tracer_provider: TracerProvider | None = None,
) -> None:
    """Set up (again) what this process exports; every argument left out takes its default.

    ``metrics`` and ``traces`` default to the environment (``EXECUTOR_OTEL_METRICS``,
    ``EXECUTOR_OTEL_TRACES``; on unless ``0``). ``registry``: the Prometheus
    ``CollectorRegistry`` to record in (default ``prometheus_client.REGISTRY``).
    ``tracer_provider``: the OpenTelemetry provider to take the tracer from (default: the
    global one, as soon as the application sets one). Calls in flight when it is called may
    be missed by the new set-up.
    """
    global _plugin
    _plugin = _Plugin(
        _enabled(_METRICS_ENV_VAR) if metrics is None else metrics,
        _enabled(_TRACES_ENV_VAR) if traces is None else traces,
        registry,
        tracer_provider,
    )


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
    traces = plugin.traces
    if traces is not None:
        traces.call_started(backend, method, call_id, world_size, non_block)


@hookimpl
def executor_call_finished(
    backend: str, method: str, call_id: int, duration_s: float, error: BaseException | None
) -> None:
    """Record the call's duration (and error); end its span."""
    plugin = _plugin or _start()
    metrics = plugin.metrics or plugin.load_metrics()
    if metrics is not None:
        metrics.finished(backend, method, duration_s, error)
    traces = plugin.traces
    if traces is not None:
        traces.call_finished(call_id, error)


@hookimpl
def executor_worker_died(
    backend: str, ranks: tuple[int, ...], node: str | None, error: WorkerDiedError
) -> None:
    """Count the workers lost."""
    plugin = _plugin or _start()
    metrics = plugin.metrics or plugin.load_metrics()
    if metrics is not None:
        metrics.died(backend, len(ranks))
    traces = plugin.traces
    if traces is not None:
        traces.worker_died(backend, ranks, node, error)


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
    traces = (_plugin or _start()).traces
    if traces is not None:
        traces.worker_rpc(context, method, duration_s, error)
