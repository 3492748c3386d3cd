"""The test cluster the k8s tests share (one API server and kubelet per session), and the
kubeconfig that points the backend's client at it (``KUBECONFIG``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from k8s_cluster import Cluster


@pytest.fixture(scope="session")
def k8s_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = Cluster()
    path = cluster.kubeconfig(tmp_path_factory.mktemp("kube") / "config")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KUBECONFIG", str(path))
        for name in ("KUBERNETES_SERVICE_HOST", "POD_NAME", "POD_UID", "POD_NAMESPACE"):
            patch.delenv(name, raising=False)
        try:
            yield cluster
        finally:
            cluster.close()


@pytest.fixture
def k8s(k8s_session: Cluster) -> Iterator[Cluster]:
    """The cluster; after the test, no object of the backend's and no container left."""
    yield k8s_session
    assert_clean(k8s_session)


def assert_clean(cluster: Cluster, bound: float = 10.0) -> None:
    """Every object the backend created is gone from the API server, every process too."""
    import time

    deadline = time.monotonic() + bound
    while cluster.kinds() or cluster.procs:
        assert time.monotonic() < deadline, f"left behind: {cluster.kinds()} {cluster.procs}"
        time.sleep(0.05)
