"""What the mp driver sends a node agent once it has joined: its node's spec. The rest of
what they say is the channel's hub protocol (:mod:`executor_channel.hub`)."""

from __future__ import annotations

import attrs

from ._local import WorkerLaunch
from ._options import MultiprocOptions

__all__ = ["NodeSpec"]


@attrs.frozen
class NodeSpec:
    """What an agent needs to start its node's workers, sent once it has joined."""

    node_rank: int
    #: The name the driver gives this node (``WorkerContext.node_id`` of its ranks).
    node_id: str
    launches: tuple[WorkerLaunch, ...]
    options: MultiprocOptions
    #: The config's device type: the agent checks there is a GPU for each worker.
    device: str
    #: The driver's ``TransportHost.worker_env`` (forwarded NCCL and gloo variables).
    worker_env: dict[str, str]
    #: Warm spares the node keeps (``MultiprocOptions.spare_workers`` with a recovery
    #: policy, else 0), and the modules they import.
    spares: int = 0
    preload: tuple[str, ...] = ()
