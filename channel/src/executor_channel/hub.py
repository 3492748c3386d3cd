"""The channel between machines, for a driver and its members on other nodes.

:class:`Hub` is the driver's side: a listener that members join; the calling thread sends
each call and reads its replies, and a pump thread keeps the heartbeats both ways and the
members' reports. A member (a node agent, say) speaks the
operations below over a :class:`~executor_channel.Connection`. Importing this module imports
zmq.
"""

from __future__ import annotations

from ._hub import STARTUP_SILENCE_S, Hub, Member
from ._hub_protocol import (
    BYE,
    CALL,
    DIED,
    END,
    FAILED,
    FRAME,
    JOIN,
    KILL,
    PING,
    PROBE,
    PROBED,
    READY,
    REFUSED,
    REPLACE,
    SPEC,
    Refusal,
    control,
    read_control,
)

__all__ = [
    "BYE",
    "CALL",
    "DIED",
    "END",
    "FAILED",
    "FRAME",
    "JOIN",
    "KILL",
    "PING",
    "PROBE",
    "PROBED",
    "READY",
    "REFUSED",
    "REPLACE",
    "SPEC",
    "STARTUP_SILENCE_S",
    "Hub",
    "Member",
    "Refusal",
    "control",
    "read_control",
]
