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
from collections.abc import Iterator, Mapping

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

__all__ = ["DURATION_BUCKETS", "Metrics", "metrics_for"]

#: Upper bounds in seconds, from an in-process call (microseconds) to a long step on a
#: cluster; ``+Inf`` follows.
DURATION_BUCKETS: tuple[float, ...] = (
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
_LE = (*(floatToGoString(b) for b in DURATION_BUCKETS), "+Inf")  # type: ignore[no-untyped-call]

_DURATION = (
    "executor_call_duration_seconds",
    "Wall time of executor calls (collective_rpc, execute_model, sleep, ...), driver side.",
)
_IN_FLIGHT = ("executor_calls_in_flight", "Executor calls started and not finished yet.")
_ERRORS = (
    "executor_call_errors",
    "Executor calls that failed, by the type of the error the caller got.",
)
_DEATHS = (
    "executor_worker_deaths",
    "Workers (ranks) lost: processes or actors that died, or the ranks of a lost node.",
)
_RECOVERIES = (
    "executor_recoveries",
    "Recoveries from a worker's death that completed (the executor is back).",
)
_RECOVERY_DURATION = (
    "executor_recovery_duration_seconds",
    "Time from the start of a recovery to workers ready for calls.",
)
_SLEEPING = (
    "executor_sleeping",
    "1 while the backend's executor has anything asleep (Executor.sleep), else 0.",
)


class _Durations:
    """One histogram series: a count per bucket (not cumulative) and the sum."""

    __slots__ = ("buckets", "sum")

    def __init__(self) -> None:
        self.buckets = [0] * len(_LE)
        self.sum = 0.0


class Metrics:
    """The executor's metrics in one ``CollectorRegistry`` (a prometheus_client collector)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}
        self._durations: dict[tuple[str, str], _Durations] = {}
        self._errors: dict[tuple[str, str, str], int] = {}
        self._deaths: dict[str, int] = {}
        self._recoveries: dict[str, _Durations] = {}
        self._sleeping: dict[str, int] = {}
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
                series = self._durations[backend, method] = _Durations()
            series.buckets[bucket] += 1
            series.sum += duration_s
            if error is not None:
                key = (backend, method, type(error).__name__)
                self._errors[key] = self._errors.get(key, 0) + 1
        finally:
            lock.release()

    def died(self, backend: str, ranks: int) -> None:
        with self._lock:
            self._deaths[backend] = self._deaths.get(backend, 0) + ranks

    def recovered(self, backend: str, duration_s: float) -> None:
        bucket = bisect_left(DURATION_BUCKETS, duration_s)
        with self._lock:
            series = self._recoveries.get(backend)
            if series is None:
                series = self._recoveries[backend] = _Durations()
            series.buckets[bucket] += 1
            series.sum += duration_s

    def sleep_changed(self, backend: str, sleeping: bool) -> None:
        with self._lock:
            self._sleeping[backend] = 1 if sleeping else 0

    # --- the collector (the scrape) ----------------------------------------------------------

    def describe(self) -> Iterator[Metric]:
        """The metric names (the registry checks them for clashes when it registers us)."""
        yield HistogramMetricFamily(*_DURATION, labels=("backend", "method"))
        yield GaugeMetricFamily(*_IN_FLIGHT, labels=("backend",))
        yield CounterMetricFamily(*_ERRORS, labels=("backend", "method", "error"))
        yield CounterMetricFamily(*_DEATHS, labels=("backend",))
        yield CounterMetricFamily(*_RECOVERIES, labels=("backend",))
        yield HistogramMetricFamily(*_RECOVERY_DURATION, labels=("backend",))
        yield GaugeMetricFamily(*_SLEEPING, labels=("backend",))

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            durations: dict[tuple[str, ...], tuple[list[int], float]] = {
                k: (list(s.buckets), s.sum) for k, s in self._durations.items()
            }
            in_flight = dict(self._in_flight)
            errors = dict(self._errors)
            deaths = dict(self._deaths)
            recoveries = {k: (list(s.buckets), s.sum) for k, s in self._recoveries.items()}
            sleeping = dict(self._sleeping)
        yield _histogram(_DURATION, ("backend", "method"), durations)
        yield _family(GaugeMetricFamily, _IN_FLIGHT, ("backend",), in_flight)
        yield _family(CounterMetricFamily, _ERRORS, ("backend", "method", "error"), errors)
        yield _family(CounterMetricFamily, _DEATHS, ("backend",), deaths)
        counts = {backend: sum(buckets) for backend, (buckets, _) in recoveries.items()}
        yield _family(CounterMetricFamily, _RECOVERIES, ("backend",), counts)
        yield _histogram(_RECOVERY_DURATION, ("backend",), {(k,): v for k, v in recoveries.items()})
        yield _family(GaugeMetricFamily, _SLEEPING, ("backend",), sleeping)


def _histogram(
    meta: tuple[str, str],
    labels: tuple[str, ...],
    series: Mapping[tuple[str, ...], tuple[list[int], float]],
) -> Metric:
    histogram = HistogramMetricFamily(*meta, labels=labels)
    for key, (buckets, total) in sorted(series.items()):
        cumulative = 0
        points: list[tuple[str, float]] = []
        for le, count in zip(_LE, buckets, strict=True):
            cumulative += count
            points.append((le, cumulative))
        histogram.add_metric(list(key), points, total)
    return histogram


def _family(
    kind: type[GaugeMetricFamily] | type[CounterMetricFamily],
    meta: tuple[str, str],
    labels: tuple[str, ...],
    values: dict[str, int] | dict[tuple[str, str, str], int],
) -> Metric:
    family = kind(*meta, labels=labels)
    for key, value in sorted(values.items()):
        family.add_metric(key if isinstance(key, tuple) else (key,), value)
    return family


_lock = threading.Lock()
# Weak keys: a registry dropped by its owner (a test's) takes its metrics with it.
_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, Metrics] = weakref.WeakKeyDictionary()


def metrics_for(registry: CollectorRegistry | None) -> Metrics:
    """The metrics of ``registry`` (default ``prometheus_client.REGISTRY``), registered there
    the first time: a registry takes each metric name once."""
    if registry is None:
        registry = REGISTRY
    with _lock:
        metrics = _by_registry.get(registry)
        if metrics is None:
            metrics = _by_registry[registry] = Metrics(registry)
        return metrics
