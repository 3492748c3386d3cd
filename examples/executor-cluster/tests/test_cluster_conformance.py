"""The example backend passes the whole conformance kit across two loopback "machines"."""

from __future__ import annotations

import pytest

from executor_core.testing import ExecutorConformanceTests

#: Agents are processes that join over TCP: seconds per executor.
pytestmark = pytest.mark.slow


class TestClusterConformance(ExecutorConformanceTests):
    """One rank on each of two machines; every executor with an odd world size on one."""

    backend = "cluster"
    world_size = 2
    num_nodes = 2
