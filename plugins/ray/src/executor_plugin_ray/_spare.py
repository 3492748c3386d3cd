"""Warm spares on Ray: idle actors on the driver's node that have imported the worker's
module, for a rank replacement to take instead of starting an actor.

With a recovery policy (``ExecutorConfig.recovery``), ``RayOptions.spare_workers`` actors wait
in the placement group, each in the bundle of a rank on the driver's node (the only ranks a
replacement brings back), asking Ray for nothing: the group reserves no more than its
ranks' bundles. A spare holds a lifeline to the driver, as every actor does, and imports the
worker class's module (torch with it, for a torch worker: most of a new actor's start). A
rank replacement takes one for a dead rank, on the rank's node, and a new spare follows.

The spare hosts the rank's worker on the devices the rank's environment names: on ``cuda``
the dead actor's GPU, which the worker's ``CUDA_VISIBLE_DEVICES`` shows (set by the
transport for every rank), and which Ray keeps for the bundle, where only this executor's
actors run. Not with ``resources_per_worker``: Ray shows other accelerators to an actor
through the resources it was given (``TPU_VISIBLE_CHIPS`` and the like), which an actor
given none would miss.
"""

from __future__ import annotations

import logging
import math
import os
from collections import deque
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from executor_core import ExecutorConfig

from ._actor import RayWorkerActor
from ._launch import kill_actors
from ._lifeline import HOLD_S, DriverLifelines
from ._options import RayOptions

__all__ = ["Spares", "spares_wanted"]

logger = logging.getLogger("executor_plugin_ray")


def spares_wanted(options: RayOptions, config: ExecutorConfig) -> int:
    """How many spares an executor keeps: ``spare_workers`` with a recovery policy that may
    replace ranks, on a bundle of CPUs and GPUs alone (see the module's docstring)."""
    recovery = config.recovery
    if recovery is None or not recovery.replace_ranks or options.resources_per_worker:
        return 0
    return options.spare_workers


class Spares:
    """The executor's spares, in the bundle ``bundle_index`` of ``group`` (a bundle of a
    rank on the driver's node). Not thread-safe: started, taken and closed by the thread
    that starts or recovers the executor, and by its cleanups."""

    def __init__(
        self,
        group: PlacementGroup,
        bundle_index: int,
        options: RayOptions,
        config: ExecutorConfig,
        count: int,
    ) -> None:
        self._group = group
        self._bundle = bundle_index
        self._config = config
        self._count = count
        self._env = dict(config.env)
        if "OMP_NUM_THREADS" not in self._env and "OMP_NUM_THREADS" not in os.environ:
            # Ray sets a rank's thread count from the CPUs it was given; a spare was given
            # none, and the count is read when torch loads, before the hand-over.
            self._env["OMP_NUM_THREADS"] = str(max(1, math.floor(options.num_cpus_per_worker)))
        # Spares connect whenever they come up: this listener stays until close(). It is
        # an abstract Unix socket (spares run on this node) that answers only the key.
        self._lifelines = DriverLifelines()
        self._address = self._lifelines.listen(None)
        #: Each spare's actor and the reference of its warm-up, oldest first.
        self._waiting: deque[tuple[Any, Any]] = deque()

    def top_up(self) -> None:
        """Start spares until ``count`` wait (returns at once: they come up meanwhile)."""
        while len(self._waiting) < self._count:
            actor = RayWorkerActor.options(
                num_cpus=0,
                num_gpus=0,
                max_restarts=0,
                max_task_retries=0,
                runtime_env={"env_vars": self._env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._group,
                    placement_group_bundle_index=self._bundle,
                    placement_group_capture_child_tasks=True,
                ),
            ).remote()
            # In order: the lifeline first, then the imports.
            actor.hold_lifeline.remote(self._address, self._lifelines.key, HOLD_S)
            self._waiting.append((actor, actor.warm_up.remote(self._config.worker_cls)))

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
                kill_actors([actor])
                continue
            return actor
        return None

    def prune(self) -> None:
        """Close the lifelines of spares that became ranks and died since."""
        self._lifelines.prune()

    def close(self) -> None:
        """Kill the spares left and close their lifelines (a cleanup)."""
        waiting, self._waiting = list(self._waiting), deque()
        kill_actors([actor for actor, _ in waiting])
        self._lifelines.close()
