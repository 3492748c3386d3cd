"""Warm spares: idle actors on the driver's node, the worker's module imported, that a rank
replacement takes instead of starting an actor.

With a recovery policy that replaces ranks, ``RayOptions.spare_workers`` actors wait in the
bundle of a rank on the driver's node (the only ranks a replacement brings back), asking Ray
for nothing: the group reserves no more than its ranks' bundles. A spare holds a lifeline to
the driver, as every actor does, and imports the worker class's module (torch with it: most of
a new actor's start). It hosts the rank's worker on the devices the rank's environment names:
on ``cuda`` the dead actor's GPU (``CUDA_VISIBLE_DEVICES``, set for every rank), which Ray
keeps for the bundle. Not with ``resources_per_worker``: Ray shows other accelerators only to
an actor given them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from collections import deque
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import PlacementGroup

from executor_core import ExecutorConfig

from ._actor import create_actor
from ._lifeline import HOLD_S, Address
from ._options import RayOptions

__all__ = ["Spares", "spares_wanted"]

logger = logging.getLogger("executor_plugin_ray")


def spares_wanted(options: RayOptions, config: ExecutorConfig) -> int:
    """How many spares an executor keeps: ``spare_workers`` with a recovery policy that may
    replace ranks, on a bundle of CPUs and GPUs alone."""
    recovery = config.recovery
    if recovery is None or not recovery.replace_ranks or options.resources_per_worker:
        return 0
    return options.spare_workers


class Spares:
    """The spares in bundle ``bundle`` of ``group``, holding a lifeline to ``lifeline``
    (address, key). Used by the thread that starts or recovers the executor."""

    def __init__(
        self,
        group: PlacementGroup,
        bundle: int,
        options: RayOptions,
        config: ExecutorConfig,
        lifeline: tuple[Address, bytes],
    ) -> None:
        env = dict(config.env)
        if "OMP_NUM_THREADS" not in env and "OMP_NUM_THREADS" not in os.environ:
            # Ray sets a rank's thread count from the CPUs it was given; a spare was given
            # none, and torch reads the count when it loads, before the hand-over.
            env["OMP_NUM_THREADS"] = str(max(1, math.floor(options.num_cpus_per_worker)))
        self._create = functools.partial(create_actor, group, bundle, options, config, env)
        self._lifeline, self._worker_cls = lifeline, config.worker_cls
        self._count = spares_wanted(options, config)
        #: Each spare's actor and the reference of its warm-up, oldest first.
        self._waiting: deque[tuple[Any, Any]] = deque()

    def top_up(self) -> None:
        """Start spares until ``count`` wait (returns at once: they come up meanwhile)."""
        while len(self._waiting) < self._count:
            actor = self._create()
            actor.hold_lifeline.remote(*self._lifeline, HOLD_S)  # in order: then the imports
            self._waiting.append((actor, actor.warm_up.remote(self._worker_cls)))

    def take(self) -> Any | None:
        """A spare's actor for a dead rank (warm, or still importing: it takes its first
        call once done), or None if none is left alive."""
        while self._waiting:
            actor, warm = self._waiting.popleft()
            try:
                ray.get(warm, timeout=0)
            except GetTimeoutError:
                return actor  # still importing: sooner than a new actor all the same
            except RayError as exc:
                logger.warning("a Ray spare is gone (%s); trying the next", exc)
                self._kill([actor])
                continue
            return actor
        return None

    def close(self) -> None:
        """Kill the spares left (a cleanup)."""
        waiting, self._waiting = list(self._waiting), deque()
        self._kill([actor for actor, _warm in waiting])

    @staticmethod
    def _kill(actors: list[Any]) -> None:
        for actor in actors if ray.is_initialized() else ():
            with contextlib.suppress(Exception):  # already dead or Ray gone
                ray.kill(actor, no_restart=True)
