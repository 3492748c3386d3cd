"""The slurm backend passes the whole conformance kit across two Slurm nodes, with the
driver on a login node: each executor asks for its allocation (salloc), runs an agent per
node in a step of its own (srun), and releases the job at shutdown."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from slurm_cluster import SlurmCluster

from executor_core.testing import ExecutorConformanceTests

#: Every executor of even world size is a Slurm job with two steps: seconds each.
pytestmark = pytest.mark.slow


class TestSlurmConformance(ExecutorConformanceTests):
    """One rank on each of n1 and n2; every executor with an odd world size on one node
    (``mp`` on this machine: the placement runs only with num_nodes > 1)."""

    backend = "slurm"
    world_size = 2
    num_nodes = 2
    #: Each restart is two new steps in the job: a few kills in a row keep it short.
    recovery_kills = 3

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def cluster(cls, slurm_session: SlurmCluster) -> Iterator[SlurmCluster]:
        """The kit's executors run on the session's cluster; none of its jobs is left."""
        slurm_session.wait_idle(30.0)
        yield slurm_session
        slurm_session.assert_clean()
