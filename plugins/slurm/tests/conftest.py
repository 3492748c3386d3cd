"""The Slurm cluster the tests share (starting one takes about a second; one per session).

Where it cannot start (not root, Slurm not installed) the tests that need it are skipped with
the reason; under CI (``CI`` set) they fail instead, since CI must run them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from slurm_cluster import SlurmCluster, cannot_run


@pytest.fixture(scope="session")
def slurm_session() -> Iterator[SlurmCluster]:
    reason = cannot_run()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the Slurm tests, but {reason}")
        pytest.skip(reason)
    with pytest.MonkeyPatch.context() as patch:
        # This process is on no node of any allocation (a login node), with this cluster.
        for name in list(os.environ):
            if name.startswith(("SLURM_", "SLURMD_", "SALLOC_", "SBATCH_", "SRUN_")):
                patch.delenv(name)
        cluster = SlurmCluster()
        patch.setenv("SLURM_CONF", str(cluster.conf))
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()


@pytest.fixture
def slurm(slurm_session: SlurmCluster) -> Iterator[SlurmCluster]:
    """The cluster, idle; after the test, no job or process of its left."""
    slurm_session.wait_idle(30.0)
    yield slurm_session
    slurm_session.assert_clean()
