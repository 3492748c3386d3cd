"""The k8s backend passes the whole conformance kit: node 0's ranks in the driver, node 1's
in a pod of the test cluster (``shape="pods"``), its agent joining over loopback."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from k8s_cluster import Cluster

from conftest import assert_clean
from executor_core.testing import ExecutorConformanceTests

#: Every executor of even world size starts a pod: seconds each.
pytestmark = pytest.mark.slow


class TestKubernetesConformance(ExecutorConformanceTests):
    """One rank here and one in a pod; every executor of odd world size on one node."""

    backend = "k8s"
    world_size = 2
    num_nodes = 2
    backend_options: ClassVar[dict[str, Any]] = {
        "image": "executor-test:1",
        "driver_runs_ranks": True,
    }
    recovery_kills = 3

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def cluster(cls, k8s_session: Cluster) -> Iterator[Cluster]:
        """The kit's executors run on the session's cluster; nothing of theirs is left."""
        yield k8s_session
        assert_clean(k8s_session)
