"""The process's Ray session for a run: a local instance, or a simulated cluster.

Starting Ray takes seconds: it is started once, before anything is timed, and every Ray side
runs in it. The ray backend's start-up is then the start of its actors in a running Ray, as
in a long-lived driver process; ``ray.init`` itself is not part of any row.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import secrets
import shutil
import sys
import tempfile
import time
from typing import Any

__all__ = ["RaySession"]


class RaySession:
    """Holds the process's Ray connection from :meth:`start` (or :meth:`cluster`) to
    :meth:`close`."""

    def __init__(self) -> None:
        self._lease: Any = None
        self._initialised = False
        self._cluster: Any = None
        self._tmp: str | None = None
        self._saved_env: dict[str, str | None] = {}
        #: Seconds ``start`` took (reported, not part of any row).
        self.start_s = 0.0

    def start(self, workers: int, **options: Any) -> None:
        """Connect to Ray as the ray backend does (its own rules, when it is installed: a
        local instance sized for the workers, or ``$RAY_ADDRESS``; ``options`` are its
        ``RayOptions``), else ``ray.init()``."""
        began = time.perf_counter()
        if importlib.util.find_spec("executor_plugin_ray") is not None:
            # The backend's own way in: a later executor in this process reuses the lease's
            # connection instead of starting another Ray.
            from executor_plugin_ray import RayOptions, acquire_ray

            self._lease = acquire_ray(RayOptions(**options), world_size=workers)
        else:
            import ray

            ray.init(include_dashboard=False, logging_level=logging.WARNING)
            self._initialised = True
        self.start_s = time.perf_counter() - began

    def cluster(
        self, head: dict[str, Any], nodes: list[dict[str, Any]], token: bool = True
    ) -> None:
        """A simulated cluster on this machine (``ray.cluster_utils.Cluster``, over loopback):
        a head node where this driver runs (``head``: its node arguments) and one node per
        entry of ``nodes`` (``add_node``'s arguments); with token authentication if ``token``
        and Ray is not imported yet (Ray reads the token when it is imported)."""
        # A short path: Ray's socket paths under it must stay within 107 bytes.
        self._tmp = tempfile.mkdtemp(prefix="executor-bench-ray-")
        os.makedirs(os.path.join(self._tmp, "ray"))
        self._set_env("RAY_TMPDIR", self._tmp)
        if token and "ray" not in sys.modules:
            self._set_env("RAY_AUTH_MODE", "token")
            self._set_env("RAY_AUTH_TOKEN", secrets.token_hex(32))
        import ray
        from ray.cluster_utils import Cluster

        self._cluster = Cluster(
            initialize_head=True, head_node_args={"include_dashboard": False, **head}
        )
        for node in nodes:
            self._cluster.add_node(**node)
        self._cluster.wait_for_nodes()
        ray.init(address=self._cluster.address, log_to_driver=False, logging_level=logging.WARNING)
        self._initialised = True

    def close(self) -> None:
        """Give the connection back (Ray stops if this session started it)."""
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        if self._initialised:
            import ray

            ray.shutdown()
            self._initialised = False
        cluster, self._cluster = self._cluster, None
        if cluster is not None:
            pids = [
                info.process.pid
                for node in cluster.list_all_nodes()
                for infos in node.all_processes.values()
                for info in infos
                if info.process is not None
            ]
            cluster.shutdown()
            # Killed nodes' object stores leave their semaphores in /dev/shm.
            with contextlib.suppress(ImportError):
                from executor_plugin_ray import remove_orphan_semaphores

                remove_orphan_semaphores(pids, wait_s=10.0)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        for name, value in self._saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._saved_env.clear()

    def _set_env(self, name: str, value: str) -> None:
        self._saved_env.setdefault(name, os.environ.get(name))
        os.environ[name] = value
