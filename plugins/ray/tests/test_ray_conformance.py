"""The Ray backend runs the core's whole conformance kit on each of its call paths: tp2 with
calls on the executor's direct sockets (the default on one node), tp2 with Ray actor calls
(as across nodes), and tp1 x pp2 with execute_model through a Ray Compiled Graph."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from executor_core import Executor, create_executor
from executor_core.backend import Registry
from executor_core.testing import ExecutorConformanceTests, ExecutorFactory
from executor_plugin_ray._executor import RayExecutor


class _RayKit(ExecutorConformanceTests):
    backend = "ray"
    world_size = 2
    #: The process's Ray connection outlives each executor (the tests share one session) and
    #: opens sockets of its own on first use; test_ray_direct checks the executor's own
    #: descriptors instead.
    check_fds = False
    #: Whether the executors of the class use the direct sockets.
    direct_calls: ClassVar[bool] = True
    #: Ray starts and stops actors in seconds.
    time_limit_s = 120.0

    @pytest.fixture(scope="class")
    @classmethod
    def executor_factory(cls, ray_local: None) -> ExecutorFactory:
        def make(registry: Registry | None = None, **overrides: Any) -> Executor:
            executor = create_executor(cls.make_config(**overrides), registry)
            assert isinstance(executor, RayExecutor)
            assert executor.uses_direct_calls == cls.direct_calls
            return executor

        return make


class TestRayConformance(_RayKit):
    """Direct calls (the default on one node)."""


class TestRayActorCallConformance(_RayKit):
    """Ray actor calls, as for workers on other nodes."""

    backend_options: ClassVar[dict[str, Any]] = {"direct_calls": False}
    direct_calls = False


class TestRayPipelineConformance(_RayKit):
    """tp1 x pp2, execute_model through a Ray Compiled Graph."""

    pipeline_parallel_size = 2
    backend_options: ClassVar[dict[str, Any]] = {"compiled_graph": True}
