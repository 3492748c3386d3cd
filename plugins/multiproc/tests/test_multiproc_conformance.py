"""The mp backend runs the core's whole conformance kit, with tensor and pipeline ranks."""

from __future__ import annotations

from typing import ClassVar

from executor_core.testing import ExecutorConformanceTests


class TestMultiprocConformance(ExecutorConformanceTests):
    """Two tensor-parallel workers."""

    #: A process per worker: the kit kills one and checks its death is reported.
    workers_are_processes: ClassVar[bool] = True

    backend = "mp"
    world_size = 2


class TestMultiprocPipelineConformance(ExecutorConformanceTests):
    """One tensor-parallel rank per stage, two pipeline stages (output rank 1), by alias."""

    backend = "multiproc"
    world_size = 2
    pipeline_parallel_size = 2
    workers_are_processes: ClassVar[bool] = True
    #: Twenty kills in a row are TestMultiprocConformance's; a few here keep CI short.
    recovery_kills = 5
