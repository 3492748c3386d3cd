"""The Ray backend runs the core's whole conformance suite: tp2 with execute_model as actor
calls (the default), and tp1 x pp2 through a Ray Compiled Graph."""

from __future__ import annotations

from typing import Any

import pytest

from executor_core import Executor, create_executor
from executor_core.testing import ExecutorConformanceTests, ExecutorFactory, conformance_config


@pytest.mark.usefixtures("ray_local")
class TestRayConformance(ExecutorConformanceTests):
    @pytest.fixture(scope="class")
    @classmethod
    def executor_factory(cls, ray_local: None) -> ExecutorFactory:
        def make(**overrides: Any) -> Executor:
            return create_executor(conformance_config("ray", world_size=2, **overrides))

        return make


@pytest.mark.usefixtures("ray_local")
class TestRayPipelineConformance(ExecutorConformanceTests):
    @pytest.fixture(scope="class")
    @classmethod
    def executor_factory(cls, ray_local: None) -> ExecutorFactory:
        def make(**overrides: Any) -> Executor:
            options = {"compiled_graph": True, **overrides.pop("backend_options", {})}
            return create_executor(
                conformance_config(
                    "ray",
                    world_size=2,
                    pipeline_parallel_size=2,
                    backend_options=options,
                    **overrides,
                )
            )

        return make
