"""The example backend passes the whole conformance kit."""

from __future__ import annotations

from executor_core.testing import ExecutorConformanceTests


class TestThreadsConformance(ExecutorConformanceTests):
    backend = "threads"
    world_size = 2
