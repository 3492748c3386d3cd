"""A node agent's workers (:class:`NodeWorkers`), and the driver's orders about them: the
liveness probe, ending the ranks declared hung, and a rank replacement.

The agent's relay thread owns the link and calls these between its reads; the workers'
rings and processes are this object's, made by ``start_workers``.
"""

from __future__ import annotations

import logging
import pickle
from typing import Any

from executor_channel import NodeRings

from ._group import WorkerGroup
from ._local import replace_workers

__all__ = ["NodeWorkers", "Replace"]

logger = logging.getLogger("executor_plugin_multiproc.agent")

#: The longest liveness probe an agent runs (it holds the relay meanwhile).
_MAX_PROBE_S = 5.0


class Replace:
    """A rank replacement the driver sent (``REPLACE``), queued in order with the calls."""

    def __init__(self, info: dict[str, Any], launches: bytes) -> None:
        self.info = info
        self.launches = launches


class NodeWorkers:
    """The workers of one node: ranks ``first_rank`` .. on ``channel``, run by ``group``."""

    def __init__(self, channel: NodeRings, group: WorkerGroup, first_rank: int) -> None:
        self.channel = channel
        self.group = group
        self.first_rank = first_rank
        #: Indices of workers that died and are not replaced yet: they do not hold the call
        #: ring (see :meth:`skip_dead`).
        self.dead: set[int] = set()

    def indices(self, info: dict[str, Any]) -> list[int]:
        """The indices of this node's workers among ``info["ranks"]``."""
        first, ranks = self.first_rank, info.get("ranks")
        held = range(first, first + len(self.channel.replies))
        valid = ranks if isinstance(ranks, list) else []
        return [r - first for r in valid if type(r) is int and r in held]

    def probe(self, info: dict[str, Any]) -> list[int]:
        """The driver's liveness probe (``PROBE``): the ranks asked about that did not
        answer. It holds the relay for at most the probe's wait, asked only once a call has
        waited the hang bound (replies are stalled then anyway)."""
        timeout = info.get("timeout_s")
        timeout = float(timeout) if isinstance(timeout, int | float) else 1.0
        silent = self.group.probes.probe(self.indices(info), min(max(timeout, 0.0), _MAX_PROBE_S))
        return sorted(self.first_rank + index for index in silent)

    def end(self, info: dict[str, Any]) -> None:
        """The driver declared these ranks hung (``END``): kill them (their deaths are
        reported as any other)."""
        self.group.kill(self.indices(info))

    def skip_dead(self) -> None:
        """A dead worker reads nothing: count it as having read every call written, so that
        the ring never waits for it (the calls it misses were for it alone to fail)."""
        for index in self.dead:
            self.channel.calls.resume_reader(index)

    def replace(self, order: Replace) -> list[int]:
        """The driver's rank replacement (see ``replace_workers``); returns the indices of
        the workers that could not be replaced (the agent reports them dead, and the driver
        then restarts every rank)."""
        # The link has authenticated the driver: only a holder of the secret sent this.
        launches = pickle.loads(order.launches)
        wanted = {self.first_rank + index for index in self.indices(order.info)}
        mine = [launch for launch in launches if launch.rank in wanted]
        failed = replace_workers(self.channel, self.group, mine, self.first_rank)
        for rank, exc in failed:
            logger.error("rank %d could not be replaced: %s", rank, exc)
        self.dead.difference_update(launch.rank - self.first_rank for launch in mine)
        return [rank - self.first_rank for rank, _ in failed]
