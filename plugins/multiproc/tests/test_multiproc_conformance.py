"""The mp backend runs the core's whole conformance suite, with tensor and pipeline ranks."""

from __future__ import annotations

from typing import Any

import pytest

from executor_core import Executor, create_executor
from executor_core.testing import ExecutorConformanceTests, ExecutorFactory, conformance_config


class TestMultiprocConformance(ExecutorConformanceTests):
    """Two tensor-parallel workers."""

    @pytest.fixture(scope="class")
    @classmethod
    def executor_factory(cls) -> ExecutorFactory:
        def make(**overrides: Any) -> Executor:
            return create_executor(conformance_config("mp", world_size=2, **overrides))

        return make


class TestMultiprocPipelineConformance(ExecutorConformanceTests):
    """One tensor-parallel rank per stage, two pipeline stages (output rank 1)."""

    @pytest.fixture(scope="class")
    @classmethod
    def executor_factory(cls) -> ExecutorFactory:
        def make(**overrides: Any) -> Executor:
            overrides.setdefault("pipeline_parallel_size", 2)
            overrides.setdefault("tensor_parallel_size", 1)
            return create_executor(conformance_config("multiproc", **overrides))

        return make
