"""Helpers of the Ray tests for a simulated cluster's nodes (``ray.cluster_utils``), in a
module of their own: a test module cannot import them from ``conftest``, a name every test
folder's conftest.py shares (the first one on ``sys.path`` wins)."""

from __future__ import annotations

from typing import Any

from ray.cluster_utils import Cluster

from executor_plugin_ray._reaper import remove_orphan_semaphores


def node_process_ids(node: Any) -> list[int]:
    """Process ids of a simulated node's Ray processes (``ray._private.node.Node``)."""
    return [
        info.process.pid
        for infos in node.all_processes.values()
        for info in infos
        if info.process is not None
    ]


def remove_node_cleanly(cluster: Cluster, node: Any) -> None:
    """``cluster.remove_node``, then drop the semaphores its killed object store left."""
    pids = node_process_ids(node)
    cluster.remove_node(node)
    remove_orphan_semaphores(pids, wait_s=10.0)
