"""Ray sessions shared by the tests: starting Ray costs seconds, so tests share one.

A process holds one Ray connection at a time. :class:`RaySessions` keeps the current one (a
local instance, a simulated two-node cluster, or none) and switches only when a module asks
for another kind; modules are ordered so that it switches rarely.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import ray
from ray._private.authentication.authentication_token_setup import _enable_token_auth
from ray.cluster_utils import Cluster
from ray_nodes import node_process_ids

from executor_plugin_ray import _cluster
from executor_plugin_ray._cluster import RayLease, acquire_ray
from executor_plugin_ray._options import RayOptions
from executor_plugin_ray._reaper import remove_orphan_semaphores

#: Logical CPUs of the shared local session: the conformance suite keeps a class-wide
#: executor (2 workers) alive while it creates fresh ones, and each worker reserves one CPU.
LOCAL_CPUS = 8


class RaySessions:
    """The test process's Ray connection: none, local, or a simulated cluster."""

    def __init__(self) -> None:
        self.kind: str | None = None
        self._lease: RayLease | None = None
        self._cluster: Cluster | None = None
        self._saved_env: dict[str, str | None] = {}
        self._cluster_tmp: str | None = None

    def local(self) -> None:
        """A local instance started the way the backend starts one (token, temp dir, reaper)."""
        if self.kind == "local":
            return
        self.close()
        options = RayOptions(local_num_cpus=LOCAL_CPUS, log_to_driver=False)
        self._lease = acquire_ray(options, world_size=1)
        self.kind = "local"

    def cluster(self, cpus_per_node: int = 1) -> Cluster:
        """A head node without CPUs and two worker nodes of ``cpus_per_node`` CPUs each."""
        if self.kind == "cluster" and self._cluster is not None:
            return self._cluster
        self.close()
        # cluster_utils writes Ray's address file under $RAY_TMPDIR/ray; the token reaches the
        # nodes through the environment, so nothing lands in /tmp/ray or ~/.ray.
        # A short path: Ray's socket paths under it must stay within 107 bytes.
        tmp = tempfile.mkdtemp(prefix="executor-ray-cluster-")
        self._cluster_tmp = tmp
        os.makedirs(os.path.join(tmp, "ray"))
        self._set_env("RAY_TMPDIR", tmp)
        self._set_env("RAY_AUTH_MODE", "token")
        # The token the backend gives its own local instances: Ray keeps the first token it
        # loads in a process-wide cache, so every session of this test process uses one.
        self._set_env("RAY_AUTH_TOKEN", _cluster._process_token)
        # Ray read its auth mode and token into process-wide caches when it was imported;
        # refresh them as ray.init does for a new local instance (private: no public API).
        _enable_token_auth()
        _cluster._reset_token_cache()
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 0, "include_dashboard": False},
        )
        self._cluster = cluster
        self.kind = "cluster"
        for _ in range(2):
            cluster.add_node(num_cpus=cpus_per_node)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, logging_level="WARNING")
        return cluster

    def _set_env(self, name: str, value: str) -> None:
        self._saved_env.setdefault(name, os.environ.get(name))
        os.environ[name] = value

    def close(self) -> None:
        """Shut down whatever is running."""
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release()
        cluster, self._cluster = self._cluster, None
        if cluster is not None:
            node_pids = _node_process_ids(cluster)
            ray.shutdown()
            cluster.shutdown()
            # Killed worker nodes' object stores leave their compiled-graph semaphores behind.
            remove_orphan_semaphores(node_pids, wait_s=10.0)
        if self._cluster_tmp is not None:
            shutil.rmtree(self._cluster_tmp, ignore_errors=True)
            self._cluster_tmp = None
        for name, value in self._saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._saved_env.clear()
        _cluster._reset_token_cache()
        self.kind = None


def _node_process_ids(cluster: Cluster) -> list[int]:
    return [pid for node in cluster.list_all_nodes() for pid in node_process_ids(node)]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run this directory's tests on the simulated cluster one after the other, where the
    last of them runs (modules run in name order, and a switch of session costs seconds).
    Every test here is also marked ``slow``: each needs a Ray session, seconds to start."""
    here = os.path.dirname(__file__)
    for item in items:
        if os.path.dirname(item.path) == here:
            item.add_marker(pytest.mark.slow)
    on_cluster = [
        item
        for item in items
        if os.path.dirname(item.path) == here
        and any(name.startswith("ray_cluster") for name in getattr(item, "fixturenames", ()))
    ]
    if not on_cluster:
        return
    moved = {id(item) for item in on_cluster}
    last = max(index for index, item in enumerate(items) if id(item) in moved)
    before = [item for item in items[: last + 1] if id(item) not in moved]
    items[:] = before + on_cluster + items[last + 1 :]


@pytest.fixture(scope="session")
def ray_sessions() -> Iterator[RaySessions]:
    sessions = RaySessions()
    try:
        yield sessions
    finally:
        sessions.close()


@pytest.fixture(scope="module")
def ray_local(ray_sessions: RaySessions) -> None:
    """The shared local Ray instance (started if another kind is running)."""
    ray_sessions.local()


@pytest.fixture(scope="module")
def ray_cluster(ray_sessions: RaySessions) -> Cluster:
    """The shared simulated two-node cluster."""
    return ray_sessions.cluster()


@pytest.fixture(scope="class")
def ray_cluster_for_class(ray_sessions: RaySessions) -> Cluster:
    """The shared simulated cluster, for a class-wide executor (the conformance kit)."""
    return ray_sessions.cluster()


@pytest.fixture
def no_ray(ray_sessions: RaySessions) -> None:
    """No Ray connection in this process, for tests of the backend's own start."""
    ray_sessions.close()
    assert not ray.is_initialized()
