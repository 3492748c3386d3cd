"""The uniproc backend runs the core's whole conformance kit."""

from __future__ import annotations

from executor_core.testing import ExecutorConformanceTests


class TestUniProcConformance(ExecutorConformanceTests):
    backend = "uni"
    world_size = 1
