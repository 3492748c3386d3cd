"""The Ray backend runs the core's whole conformance suite on each of its call paths: tp2
with calls on the executor's direct sockets (the default on one node), tp2 with Ray actor
calls (as across nodes), and tp1 x pp2 with execute_model through a Ray Compiled Graph."""

from __future__ import annotations

from typing import Any

import pytest

from executor_core import Executor, create_executor
from executor_core.testing import ExecutorConformanceTests, ExecutorFactory, conformance_config
from executor_plugin_ray._executor import RayExecutor


def factory(direct_calls: bool, **fixed: Any) -> ExecutorFactory:
    """Executors with ``fixed`` settings (and backend options) under the test's overrides."""
    fixed_options = fixed.pop("backend_options", {})

    def make(**overrides: Any) -> Executor:
        options = {**fixed_options, **overrides.pop("backend_options", {})}
        settings = {"world_size": 2, **fixed, **overrides}
        executor = create_executor(conformance_config("ray", backend_options=options, **settings))
        assert isinstance(executor, RayExecutor)
        assert executor.uses_direct_calls == direct_calls
        return executor

    return make


@pytest.mark.usefixtures("ray_local")
class TestRayConformance(ExecutorConformanceTests):
    @pytest.fixture(scope="class")
    @classmethod
    def executor_factory(cls, ray_local: None) -> ExecutorFactory:
        return factory(direct_calls=True)


@pytest.mark.usefixtures("ray_local")
class TestRayActorCallConformance(ExecutorConformanceTests):
    @pytest.fixture(scope="class")
    @classmethod
    def executor_factory(cls, ray_local: None) -> ExecutorFactory:
        return factory(direct_calls=False, backend_options={"direct_calls": False})


@pytest.mark.usefixtures("ray_local")
class TestRayPipelineConformance(ExecutorConformanceTests):
    @pytest.fixture(scope="class")
    @classmethod
    def executor_factory(cls, ray_local: None) -> ExecutorFactory:
        return factory(
            direct_calls=True, pipeline_parallel_size=2, backend_options={"compiled_graph": True}
        )
