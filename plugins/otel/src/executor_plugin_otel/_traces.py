"""The OpenTelemetry spans: one per call in the driver, one per rank and call in each worker.

Nothing here imports OpenTelemetry until there is somewhere to send spans: a provider given to
``configure``, or a global ``TracerProvider`` the application set (which it can only do after
importing ``opentelemetry.trace``). Until then each hook costs a dictionary look-up; the
tracer is taken once the application sets a provider (a global provider is set once for good).

A blocking call's span is the current span while the call runs, in the caller's thread: spans
the worker's code opens there (the ``uni`` backend's direct calls) and the worker span are its
children. Worker processes (``mp``, ``ray``) get no trace context over the wire: their spans
start traces of their own, tied to the driver's by their attributes (backend, method, rank)
and time.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from contextvars import Token
    from types import ModuleType

    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer, TracerProvider

    from executor_core import WorkerContext, WorkerDiedError

__all__ = ["TRACER_NAME", "Traces"]

#: The instrumentation scope of the spans.
TRACER_NAME = "executor_plugin_otel"
#: OpenTelemetry's variable naming a provider to load on first use.
_PROVIDER_ENV_VAR = "OTEL_PYTHON_TRACER_PROVIDER"


class Traces:
    """Spans of calls, in the driver and in worker processes."""

    def __init__(self, provider: TracerProvider | None, version: str) -> None:
        self._provider = provider
        self._version = version
        self._env_provider = _PROVIDER_ENV_VAR in os.environ
        self._tracer: Tracer | None = None
        #: opentelemetry.context and opentelemetry.trace, once there is a tracer.
        self._context: ModuleType
        self._trace: ModuleType
        #: Driver spans of calls in flight, by call id, with the context token of a blocking
        #: call's span (made current in the caller's thread until the call finishes).
        self._spans: dict[int, tuple[Span, Token[Context] | None]] = {}

    def tracer(self) -> Tracer | None:
        """The tracer, or None while nothing would receive spans."""
        tracer = self._tracer
        if tracer is not None:
            return tracer
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

        self._context, self._trace = context, trace
        tracer = self._tracer = provider.get_tracer(TRACER_NAME, self._version)
        return tracer

    # --- driver ------------------------------------------------------------------------------

    def call_started(
        self, backend: str, method: str, call_id: int, world_size: int, non_block: bool
    ) -> None:
        tracer = self._tracer or self.tracer()
        if tracer is None:
            return
        trace = self._trace
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
            token = self._context.attach(trace.set_span_in_context(span))
        self._spans[call_id] = (span, token)

    def call_finished(self, call_id: int, error: BaseException | None) -> None:
        entry = self._spans.pop(call_id, None)
        if entry is None:  # started while spans had nowhere to go
            return
        span, token = entry
        if token is not None:
            self._context.detach(token)
        if error is not None:
            _record_error(span, error)
        span.end()

    def worker_died(
        self, backend: str, ranks: tuple[int, ...], node: str | None, error: WorkerDiedError
    ) -> None:
        tracer = self._tracer or self.tracer()
        if tracer is None:
            return
        attributes: dict[str, Any] = {"executor.backend": backend, "executor.ranks": list(ranks)}
        if node is not None:
            attributes["executor.node"] = node
        span = tracer.start_span("executor worker_died", attributes=attributes)
        _record_error(span, error)
        span.end()

    # --- worker ------------------------------------------------------------------------------

    def worker_rpc(
        self,
        context: WorkerContext,
        method: str,
        duration_s: float,
        error: BaseException | None,
    ) -> None:
        tracer = self._tracer or self.tracer()
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


def _record_error(span: Span, error: BaseException) -> None:
    from opentelemetry.trace import Status, StatusCode

    kind = type(error).__qualname__
    span.set_attribute("error.type", kind)
    span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, f"{kind}: {error}"))
