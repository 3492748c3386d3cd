"""What a hub (the driver) and its members (node agents, workers) say over their link.

Every message is a list of parts whose first part is one byte, the operation (:class:`Op`). Control
messages carry JSON; a member's spec is opaque bytes (its backend's); calls and replies are
codec frames, forwarded as they are.

Hub to member: ``SPEC`` (or ``REFUSED``), ``READY`` once every member is ready, then ``CALL``
frames (the stop message is a call frame of kind ``Kind.STOP``) and, in order with them,
``REPLACE`` (a rank replacement), ``PING``, ``PROBE`` and ``END`` (the hang bound's), and,
to stop at once, ``KILL``. Member to hub: ``JOIN``, then
``FRAME`` (a worker's ready or reply frame), ``DIED``, ``FAILED``, ``PING``, ``PROBED`` and,
once its workers have stopped, ``BYE``.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from typing import Any

from .._codec import OOB_BYTES_THRESHOLD

__all__ = ["Op", "Refusal", "call_message"]


class Refusal(enum.StrEnum):
    """Why a hub refused a ``JOIN``: the ``refusal`` of a ``REFUSED`` message."""

    #: The join request lacks a field or has one of the wrong type.
    MALFORMED = "malformed"
    #: The member runs another version than the hub.
    VERSION = "version"
    #: The member was started for another job (its ``expects`` differ from the hub's).
    MISMATCH = "mismatch"
    #: Its node rank is not one of the job's.
    OUT_OF_RANGE = "out_of_range"
    #: Another member holds its node rank.
    TAKEN = "taken"
    #: Its node rank is the job's, held by no one, and not awaited now (its member was lost
    #: or has stopped).
    NOT_AWAITED = "not_awaited"


class Op:
    """The operations of the hub's protocol (each one byte, the first part of a message), and
    the framing of its control messages (:meth:`frame`, :meth:`read`)."""

    #: Member to hub: who it is, its first message. JSON: ``node_rank`` (its node or rank),
    #: ``hostname``, ``pid``, ``version`` and, optionally, ``expects``: facts about the job the
    #: member was started for (``{"num_nodes": 3}``), refused if the hub's differ.
    JOIN = b"J"
    #: Hub to member: the spec of what to run (the backend's bytes), the answer to ``JOIN``.
    SPEC = b"S"
    #: Hub to member: the join is refused, at once; the member exits. JSON: ``reason`` (a
    #: sentence saying why), ``refusal`` (a :class:`Refusal` value) and ``awaited`` (the node
    #: ranks awaited now), for the member to say what to do.
    REFUSED = b"R"
    #: Hub to member: every member is ready; calls follow.
    READY = b"A"
    #: Hub to member: a call frame of the codec, forwarded as it is, in one part or several (to
    #: be joined back to back: the hub sends large immutable buffers without copying them).
    CALL = b"C"
    #: Member to hub: a worker's ready or reply frame of the codec, forwarded as it is.
    FRAME = b"F"
    #: Either way: a heartbeat.
    PING = b"P"
    #: Hub to member: the liveness probe of some of its ranks (JSON: ``token``, ``ranks``,
    #: ``timeout_s``); answered with ``PROBED``.
    PROBE = b"Q"
    #: Member to hub: the answer to ``PROBE`` (JSON: its ``token``, and the ``silent`` ranks: those
    #: whose process did not answer within ``timeout_s``).
    PROBED = b"q"
    #: Hub to member: end these ranks' processes now (JSON: ``ranks``), declared hung.
    END = b"E"
    #: Member to hub: a worker of its node died (JSON: rank, exit code, ``ended`` if by END).
    DIED = b"D"
    #: Hub to every member, in order with the calls (a rank replacement): start new processes
    #: for these of its ranks (JSON: ``ranks``; then the backend's bytes for them). The calls
    #: before it are for the dead processes; the new ones read from the next call on.
    REPLACE = b"W"
    #: Member to hub: it could not start its workers or serve on (JSON: why).
    FAILED = b"X"
    #: Hub to member: stop every worker now, without waiting for calls in flight. JSON,
    #: optional: ``rejoin`` true asks the member to join the same hub address again afterwards
    #: (the executor restarts its workers).
    KILL = b"K"
    #: Member to hub: its workers have stopped; the last message of the link.
    BYE = b"B"

    @staticmethod
    def frame(op: bytes, payload: dict[str, Any]) -> list[bytes]:
        """A control message: the operation and a JSON object."""
        return [op, json.dumps(payload).encode()]

    @staticmethod
    def read(parts: Sequence[memoryview]) -> dict[str, Any]:
        """The JSON object of a control message (a malformed one reads as empty)."""
        if len(parts) < 2:
            return {}
        try:
            value = json.loads(bytes(parts[1]))
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


def call_message(parts: Sequence[Any]) -> list[Any]:
    """The ``CALL`` message of a call frame (the codec's parts), safe to send later: what a
    caller could change once the call is sent is copied, a large buffer of immutable
    ``bytes`` is kept as it is (no copy), between the joined runs of the other parts."""
    message: list[Any] = [Op.CALL]
    run: list[memoryview] = []
    for part in parts:
        view = memoryview(part)
        if view.nbytes >= OOB_BYTES_THRESHOLD and type(view.obj) is bytes:
            if run:
                message.append(b"".join(run))
                run = []
            message.append(view)
        else:
            run.append(view)
    if run:
        message.append(b"".join(run))
    return message
