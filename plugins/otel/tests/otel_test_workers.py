"""Workers for the otel plugin's tests, importable by qualname in worker processes."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from executor_core.testing import ConformanceWorker

#: Where a SpanFileWorker's process writes its finished spans, one JSON object a line.
SPANS_ENV_VAR = "EXECUTOR_OTEL_TEST_SPANS"


class JsonLinesExporter(SpanExporter):
    """Appends each finished span to a file (the test reads it from the driver)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with open(self.path, "a", encoding="utf-8") as out:
            for span in spans:
                parent = span.parent
                record = {
                    "name": span.name,
                    "pid": os.getpid(),
                    "attributes": dict(span.attributes or {}),
                    "status": span.status.status_code.name,
                    "parent": None if parent is None else parent.span_id,
                }
                out.write(json.dumps(record) + "\n")
        return SpanExportResult.SUCCESS


class SpanFileWorker(ConformanceWorker):
    """Sets up the OpenTelemetry SDK in its own process, as an application would, so that the
    otel plugin's worker-side hook records spans there."""

    def init_device(self) -> None:
        super().init_device()
        provider = TracerProvider()
        provider.add_span_processor(
            SimpleSpanProcessor(JsonLinesExporter(os.environ[SPANS_ENV_VAR]))
        )
        trace.set_tracer_provider(provider)
