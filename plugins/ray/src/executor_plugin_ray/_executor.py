"""RayExecutor: one Ray actor per rank, in a placement group, on one node or many."""

from __future__ import annotations

from typing import ClassVar

from executor_core import Executor
from executor_core.backend import Transport

from ._options import RayOptions
from ._placement import WorkerPlacement
from ._transport import RayTransport

__all__ = ["RayExecutor"]


class RayExecutor(Executor):
    """Runs each rank's worker in a Ray actor (backend ``"ray"``): Ray places and watches
    them; calls go through the channel (the driver node's shared-memory rings, the hub for
    other nodes). See the distribution's README and :class:`~._transport.RayTransport`."""

    transport_cls: ClassVar[type[Transport]] = RayTransport
    #: The backend_options it takes (the core refuses any other key).
    options_cls = RayOptions

    @property
    def transport(self) -> RayTransport:
        """The Ray transport."""
        transport = super().transport
        assert isinstance(transport, RayTransport)
        return transport

    @property
    def placements(self) -> list[WorkerPlacement]:
        """Each rank's node id, node IP, local rank and actor pid, in rank order."""
        return list(self.transport.placements)

    @property
    def options(self) -> RayOptions:
        """The validated ``backend_options``."""
        return self.transport.options

    @property
    def ranks_on_rings(self) -> tuple[int, ...]:
        """The ranks on the driver's node, which read calls from its shared-memory rings."""
        return self.transport.ranks_on_rings

    @property
    def ranks_on_hub(self) -> tuple[int, ...]:
        """The ranks on other nodes, which get calls through the authenticated hub."""
        return self.transport.ranks_on_hub
