"""The example backend passes the whole conformance kit across two loopback "machines"."""

from __future__ import annotations

from typing import ClassVar

import pytest

from executor_core.testing import ExecutorConformanceTests

#: Agents are processes that join over TCP: seconds per executor.
pytestmark = pytest.mark.slow


class TestClusterConformance(ExecutorConformanceTests):
    """One rank on each of two machines; every executor with an odd world size on one."""

    backend = "cluster"
    world_size = 2
    num_nodes = 2
    workers_are_processes: ClassVar[bool] = True
    #: Each restart starts two agents: a few kills in a row keep the test short.
    recovery_kills = 5
