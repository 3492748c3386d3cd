"""What a hub (the driver) and its members (node agents, workers) say over their link.

Every message is a list of parts whose first part is one byte, the operation. Control
messages carry JSON; a member's spec is opaque bytes (its backend's); calls and replies are
codec frames, forwarded as they are.

Hub to member: ``SPEC`` (or ``REFUSED``), ``READY`` once every member is ready, then ``CALL``
frames (the stop message is a call frame of kind ``KIND_STOP``), ``PING`` and, to stop at
once, ``KILL``. Member to hub: ``JOIN``, then ``FRAME`` (a worker's ready or reply frame),
``DIED``, ``FAILED``, ``PING`` and, once its workers have stopped, ``BYE``.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = [
    "BYE",
    "CALL",
    "DIED",
    "FAILED",
    "FRAME",
    "JOIN",
    "KILL",
    "PING",
    "READY",
    "REFUSED",
    "SPEC",
    "control",
    "read_control",
]

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
