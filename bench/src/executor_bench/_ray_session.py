"""The process's Ray session for a run.

Starting Ray takes seconds: it is started once, before anything is timed, and every Ray side
runs in it. The ray backend's start-up is then the start of its actors in a running Ray, as
in a long-lived driver process; ``ray.init`` itself is not part of any row.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from typing import Any

__all__ = ["RaySession"]


class RaySession:
    """Holds the process's Ray connection from :meth:`start` to :meth:`close`."""

    def __init__(self) -> None:
        self._lease: Any = None
        self._initialised = False
        #: Seconds ``start`` took (reported, not part of any row).
        self.start_s = 0.0

    def start(self, workers: int) -> None:
        """Connect to Ray as the ray backend does (its own rules, when it is installed: a
        local instance sized for the workers, or ``$RAY_ADDRESS``), else ``ray.init()``."""
        began = time.perf_counter()
        if importlib.util.find_spec("executor_plugin_ray") is not None:
            # The backend's own way in: a later executor in this process reuses the lease's
            # connection instead of starting another Ray.
            from executor_plugin_ray import RayOptions, acquire_ray

            self._lease = acquire_ray(RayOptions(), world_size=workers)
        else:
            import ray

            ray.init(include_dashboard=False, logging_level=logging.WARNING)
            self._initialised = True
        self.start_s = time.perf_counter() - began

    def close(self) -> None:
        """Give the connection back (Ray stops if this session started it)."""
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        if self._initialised:
            import ray

            ray.shutdown()
            self._initialised = False
