"""What the driver and a node agent say to each other over their authenticated link.

Every message is a list of parts whose first part is one byte, the operation. Control
messages carry JSON; the node's spec carries pickle (the link has authenticated the driver
before it is unpickled); calls and replies carry codec frames, forwarded as they are.

Driver to agent: ``SPEC`` (or ``REFUSED``), ``READY`` once every rank of every node is
ready, then ``CALL`` frames (the stop message is a
call frame of kind ``KIND_STOP``), ``PING`` and, to stop at once, ``KILL``.
Agent to driver: ``JOIN``, then ``FRAME`` (a worker's ready or reply frame), ``DIED``,
``FAILED``, ``PING`` and, once its workers have stopped, ``BYE``.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from ._local import WorkerLaunch
from ._options import MultiprocOptions

__all__ = ["NodeSpec", "control", "read_control"]

JOIN = b"J"
SPEC = b"S"
REFUSED = b"R"
READY = b"A"
CALL = b"C"
FRAME = b"F"
PING = b"P"
DIED = b"D"
FAILED = b"X"
KILL = b"K"
BYE = b"B"


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


def control(op: bytes, payload: dict[str, Any]) -> list[bytes]:
    """A control message: the operation and a JSON object."""
    return [op, json.dumps(payload).encode()]


def read_control(parts: tuple[memoryview, ...]) -> dict[str, Any]:
    """The JSON object of a control message (a malformed one reads as empty)."""
    if len(parts) < 2:
        return {}
    try:
        value = json.loads(bytes(parts[1]))
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
