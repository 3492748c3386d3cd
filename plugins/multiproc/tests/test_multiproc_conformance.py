"""The mp backend runs the core's whole conformance kit, with tensor and pipeline ranks."""

from __future__ import annotations

from executor_core.testing import ExecutorConformanceTests, layout_variant


class TestMultiprocConformance(ExecutorConformanceTests):
    """Two tensor-parallel workers."""

    backend = "mp"
    world_size = 2


@layout_variant
class TestMultiprocPipelineConformance(ExecutorConformanceTests):
    """One tensor-parallel rank per stage, two pipeline stages (output rank 1), by alias: two
    worker processes on one node, as in TestMultiprocConformance, whose alone are the tests
    that do not see the layout (``layout_variant``); the alias is gone through by every test
    here."""

    backend = "multiproc"
    world_size = 2
    pipeline_parallel_size = 2
