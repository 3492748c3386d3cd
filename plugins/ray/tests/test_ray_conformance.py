"""The Ray backend runs the core's whole conformance kit on both halves of the channel: tp2
with the workers on the driver's node (shared-memory rings), and tp2 on a simulated cluster
with the workers on the other nodes (the authenticated hub). The pipeline layout's rules are
the core's and the wrapper's, which ``mp``'s tp1 x pp2 kit checks on the same rings
(``TestMultiprocPipelineConformance``; across nodes, ``TestTwoNodePipelineConformance``)."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from ray.cluster_utils import Cluster

from executor_core import Executor, create_executor
from executor_core.backend import Registry
from executor_core.testing import ExecutorConformanceTests, ExecutorFactory
from executor_plugin_ray._executor import RayExecutor


class _RayKit(ExecutorConformanceTests):
    backend = "ray"
    world_size = 2
    #: The process's Ray connection outlives each executor (the tests share one session) and
    #: opens sockets of its own on first use, so descriptors are not the executor's alone.
    check_fds = False
    #: Ray starts and stops actors in seconds.
    time_limit_s = 120.0
    #: Whether the workers of the class's executors are on the driver's node.
    on_rings: ClassVar[bool] = True

    @classmethod
    def _check(cls, executor: Executor) -> Executor:
        assert isinstance(executor, RayExecutor)
        ranks = tuple(range(executor.world_size))
        assert executor.ranks_on_rings == (ranks if cls.on_rings else ())
        assert executor.ranks_on_hub == (() if cls.on_rings else ranks)
        return executor


class _LocalKit(_RayKit):
    @pytest.fixture(scope="class")
    @classmethod
    def executor_factory(cls, ray_local: None) -> ExecutorFactory:
        def make(registry: Registry | None = None, **overrides: Any) -> Executor:
            return cls._check(create_executor(cls.make_config(**overrides), registry))

        return make


class TestRayConformance(_LocalKit):
    """Two tensor-parallel workers on the driver's node."""


class TestRayClusterConformance(_RayKit):
    """Two workers on the other nodes of a simulated cluster: every call crosses the hub."""

    on_rings = False
    #: Every rank is a member of the hub here, and a lost member is not admitted again yet:
    #: ray replaces only the ranks on the driver's node, so these deaths restart the group.
    replaces_ranks = False
    backend_options: ClassVar[dict[str, Any]] = {
        "placement_strategy": "SPREAD",
        # The cluster's worker nodes have one CPU each, and the kit runs several executors
        # at once.
        "num_cpus_per_worker": 0.1,
        "log_to_driver": False,
    }

    @pytest.fixture(scope="class")
    @classmethod
    def executor_factory(cls, ray_cluster_for_class: Cluster) -> ExecutorFactory:
        def make(registry: Registry | None = None, **overrides: Any) -> Executor:
            return cls._check(create_executor(cls.make_config(**overrides), registry))

        return make
