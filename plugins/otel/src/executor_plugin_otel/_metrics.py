"""The Prometheus metrics, recorded in the driver (imported on the first observed call).

One collector holds them all, as plain numbers updated under one lock per hook call, and
builds prometheus_client's metric families when the registry is scraped. Recording a call
costs one lock and a few dictionary updates (prometheus_client's own Histogram and Gauge take
a lock per value: about three times as long per call).
"""

from __future__ import annotations

import threading
import weakref
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from itertools import accumulate
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

__all__ = ["DURATION_BUCKETS", "Metrics", "metrics_for"]

#: Upper bounds in seconds (1, 2.5, 5 per decade), from an in-process call (microseconds) to a
#: long step on a cluster; ``+Inf`` follows.
DURATION_BUCKETS: tuple[float, ...] = (
    *(float(f"{m}e{e}") for e in range(-5, 1) for m in (1, 2.5, 5)),
    10.0,
    30.0,
    60.0,
)
_LE = (*(floatToGoString(b) for b in DURATION_BUCKETS), "+Inf")  # type: ignore[no-untyped-call]

#: Each metric's family class, name and labels, in the order of ``Metrics._values``.
_METRICS: tuple[tuple[Any, str, tuple[str, ...]], ...] = (
    (HistogramMetricFamily, "executor_call_duration_seconds", ("backend", "method")),
    (GaugeMetricFamily, "executor_calls_in_flight", ("backend",)),
    (CounterMetricFamily, "executor_call_errors", ("backend", "method", "error")),
    (CounterMetricFamily, "executor_worker_deaths", ("backend",)),
    (CounterMetricFamily, "executor_recoveries", ("backend",)),
    (HistogramMetricFamily, "executor_recovery_duration_seconds", ("backend",)),
    (GaugeMetricFamily, "executor_sleeping", ("backend",)),
)
_HELP = {
    "executor_call_duration_seconds": (
        "Wall time of executor calls (collective_rpc, execute_model, sleep, ...), driver side."
    ),
    "executor_calls_in_flight": "Executor calls started and not finished yet.",
    "executor_call_errors": "Executor calls that failed, by the type of the error the caller got.",
    "executor_worker_deaths": (
        "Workers (ranks) lost: processes or actors that died, or the ranks of a lost node."
    ),
    "executor_recoveries": (
        "Recoveries from a worker's death that completed (the executor is back)."
    ),
    "executor_recovery_duration_seconds": (
        "Time from the start of a recovery to workers ready for calls."
    ),
    "executor_sleeping": (
        "1 while the backend's executor has anything asleep (Executor.sleep), else 0."
    ),
}


class Metrics:
    """The executor's metrics in one ``CollectorRegistry`` (a prometheus_client collector)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._lock = threading.Lock()
        #: One dict per metric of ``_METRICS``, by label values (a string for one label). A
        #: histogram's value is a count per bucket (not cumulative), then the sum.
        self._values: tuple[dict[Any, Any], ...] = tuple({} for _ in _METRICS)
        self._durations, self._in_flight, self._errors, self._deaths = self._values[:4]
        self._recoveries, self._recovery_durations, self._sleeping = self._values[4:]
        registry.register(self)

    # --- recording (the hooks) ------------------------------------------------------------

    # acquire() and release() rather than ``with``: half the cost, on the hot path.

    def started(self, backend: str) -> None:
        lock = self._lock
        lock.acquire()
        try:
            in_flight = self._in_flight
            in_flight[backend] = in_flight.get(backend, 0) + 1
        finally:
            lock.release()

    def finished(
        self, backend: str, method: str, duration_s: float, error: BaseException | None
    ) -> None:
        bucket = bisect_left(DURATION_BUCKETS, duration_s)  # the first bound >= duration
        lock = self._lock
        lock.acquire()
        try:
            in_flight = self._in_flight
            in_flight[backend] = in_flight.get(backend, 0) - 1
            series = self._durations.get((backend, method))
            if series is None:
                series = self._durations[backend, method] = [0] * len(_LE) + [0.0]
            series[bucket] += 1
            series[-1] += duration_s
            if error is not None:
                key = (backend, method, type(error).__name__)
                self._errors[key] = self._errors.get(key, 0) + 1
        finally:
            lock.release()

    def died(self, backend: str, ranks: int) -> None:
        with self._lock:
            self._deaths[backend] = self._deaths.get(backend, 0) + ranks

    def recovered(self, backend: str, duration_s: float) -> None:
        with self._lock:
            self._recoveries[backend] = self._recoveries.get(backend, 0) + 1
            series = self._recovery_durations.setdefault(backend, [0] * len(_LE) + [0.0])
            series[bisect_left(DURATION_BUCKETS, duration_s)] += 1
            series[-1] += duration_s

    def sleep_changed(self, backend: str, sleeping: bool) -> None:
        with self._lock:
            self._sleeping[backend] = 1 if sleeping else 0

    # --- the collector (the scrape) ----------------------------------------------------------

    def describe(self) -> Iterator[Metric]:
        """The metric names (the registry checks them for clashes when it registers us)."""
        return _families([{} for _ in _METRICS])

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            values = [
                {key: list(v) if isinstance(v, list) else v for key, v in series.items()}
                for series in self._values
            ]
        return _families(values)


def _families(values: Sequence[dict[Any, Any]]) -> Iterator[Metric]:
    for (kind, name, labels), series in zip(_METRICS, values, strict=True):
        family = kind(name, _HELP[name], labels=labels)
        for key, value in sorted(series.items()):
            key = key if isinstance(key, tuple) else (key,)
            if kind is HistogramMetricFamily:
                family.add_metric(
                    key, list(zip(_LE, accumulate(value[:-1]), strict=True)), value[-1]
                )
            else:
                family.add_metric(key, value)
        yield family


_lock = threading.Lock()
# Weak keys: a registry dropped by its owner (a test's) takes its metrics with it.
_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, Metrics] = weakref.WeakKeyDictionary()


def metrics_for(registry: CollectorRegistry | None) -> Metrics:
    """The metrics of ``registry`` (default ``prometheus_client.REGISTRY``), registered there
    the first time: a registry takes each metric name once."""
    registry = registry or REGISTRY
    with _lock:
        metrics = _by_registry.get(registry)
        if metrics is None:
            metrics = _by_registry[registry] = Metrics(registry)
        return metrics
