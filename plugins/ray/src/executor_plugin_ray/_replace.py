"""Rank replacement on Ray: a new actor for each dead rank, in the dead actor's bundle.

The placement group outlives its actors, and a bundle stays on its node: an actor created
in the dead one's bundle lands where it ran, on its GPU, so the rank keeps its place and
its local rank. A warm spare (``_spare``), when one waits, is taken instead: it runs on that
node already. The transport then hands it the same rings (``RayTransport.replace``).

Only ranks on the driver's node are replaced. A rank on another node joined the hub as a
member of its own, and the hub admits members only while the executor starts; such a
death restarts the group (``RayTransport.replace`` raises ``NotImplementedError``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
from ray.util.placement_group import PlacementGroup

from executor_core import ExecutorConfig, ExecutorError

from ._launch import Startup, create_actor, hold_lifelines, kill_actors
from ._lifeline import DriverLifelines
from ._options import RayOptions
from ._ranks import ActorInfo, WorkerPlacement
from ._spare import Spares, spares_wanted

__all__ = ["ActorSlots"]


@attrs.define(eq=False)
class ActorSlots:
    """What the start keeps to put a new actor in a dead one's place."""

    group: PlacementGroup
    #: The actors in bundle order. The start's cleanup kills the actors of this very list,
    #: so it kills a replacement as well (and holds no dead actor's handle).
    created: list[Any]
    #: What each actor reported at start (by bundle), to check that a new one landed there.
    infos: list[ActorInfo]
    #: The driver's end of every actor's lifeline, and the node this process runs on.
    lifelines: DriverLifelines
    driver_node: str
    #: Warm actors a replacement takes first (:meth:`start_spares`), if any.
    spares: Spares | None = None

    def start_spares(
        self,
        options: RayOptions,
        config: ExecutorConfig,
        bundle_index: int,
        add_cleanup: Callable[[Callable[[], None]], None],
    ) -> None:
        """Keep the executor's spares in ``bundle_index`` (a bundle on the driver's node),
        if it wants any (:func:`spares_wanted`), once its ranks are ready."""
        count = spares_wanted(options, config)
        if count:
            self.spares = Spares(self.group, bundle_index, options, config, count)
            add_cleanup(self.spares.close)
            self.spares.top_up()

    def replace(
        self,
        placements: list[WorkerPlacement],
        ranks: Sequence[int],
        options: RayOptions,
        config: ExecutorConfig,
        startup: Startup,
        deadline: float,
    ) -> list[Any]:
        """New actors for ``ranks``, in their dead actors' bundles (in the order of
        ``ranks``), holding a lifeline; ``placements`` gets their pids. Raises
        :class:`ExecutorError` if one landed on another node or GPU (its bundle moved with a
        lost node: the transport's rings and the rank's local rank would be wrong, so the
        group restarts)."""
        fresh, started = [], []
        for rank in ranks:
            index = placements[rank].actor_index
            # Dead already, or as good as (killed as hung, its process may still end):
            # either way its bundle must be free before a new actor can be scheduled.
            kill_actors([self.created[index]])
            actor = self.spares.take() if self.spares is not None else None
            if actor is None:
                actor = create_actor(self.group, options, config, index)
                started.append(rank)
            self.created[index] = actor
            fresh.append(actor)
        infos = startup.gather(
            [actor.node_info.remote() for actor in fresh], "node_info", deadline, ranks
        )
        for rank, info in zip(ranks, infos, strict=True):
            placement = placements[rank]
            before = self.infos[placement.actor_index]
            if rank not in started:  # a spare: asked Ray for no GPU, it uses the rank's
                info = attrs.evolve(info, gpu_ids=before.gpu_ids)
            if (info.node_id, info.gpu_ids) != (before.node_id, before.gpu_ids):
                raise ExecutorError(
                    f"the new Ray actor of rank {rank} landed on node {info.node_id} (GPUs "
                    f"{list(info.gpu_ids)}), not where rank {rank} ran (node "
                    f"{before.node_id}, GPUs {list(before.gpu_ids)})"
                )
            self.infos[placement.actor_index] = info
            placements[rank] = attrs.evolve(placement, pid=info.pid)
        if started:  # a spare holds its lifeline already
            new = [fresh[ranks.index(rank)] for rank in started]
            mine = [placements[rank] for rank in started]
            hold_lifelines(self.lifelines, new, mine, self.driver_node, startup, deadline)
        # The dead actors' lifelines are closed at their end by now (their process is
        # gone): close this end.
        self.lifelines.prune()
        if self.spares is not None:
            self.spares.prune()
            self.spares.top_up()
        return fresh
