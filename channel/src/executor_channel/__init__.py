"""executor-channel: authenticated message links between the nodes of an Executor SDK job.

A :class:`Listener` (zmq ROUTER, on loopback unless told otherwise) and the
:class:`Connection` objects that dial it exchange messages made of bytes-like parts. Every
frame carries a MAC (GMAC, under keys derived from a shared :class:`Secret`) and is checked
(structure, lengths, MAC, freshness) before the caller sees a byte of it; frames that fail
are dropped, counted per :class:`DropReason` and logged once per peer. The link never
unpickles: callers decode the parts they are handed. Frames are authenticated, not
encrypted; see ``docs/security.md`` for the threat model.

Within a node, :mod:`executor_channel.shm` carries the same frames through shared-memory
rings, and :mod:`executor_channel.codec` makes them (pickle 5, out-of-band buffers).
"""

from __future__ import annotations

from executor_core.backend import lazy_getattr

# Not typing.TYPE_CHECKING (importing typing costs time here); type checkers treat any
# constant of this name as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._connection import Connection
    from ._frames import DropReason, Limits
    from ._link import BytesLike, ChannelError, ChannelTimeoutError, Message, PeerId
    from ._listener import LOOPBACK, Listener
    from ._secret import (
        ENV_SECRET,
        ENV_SECRET_FILE,
        Secret,
        SecretError,
        load_secret,
    )

#: Names imported on first use: a worker on the driver's node uses only the shared-memory
#: half (:mod:`executor_channel.shm`) and never pays for importing zmq.
_LAZY: dict[str, str] = {
    "DropReason": "._frames",
    "Limits": "._frames",
    "Connection": "._connection",
    "LOOPBACK": "._listener",
    "Listener": "._listener",
    **{
        name: "._link"
        for name in ("BytesLike", "ChannelError", "ChannelTimeoutError", "Message", "PeerId")
    },
    **{
        name: "._secret"
        for name in (
            "ENV_SECRET",
            "ENV_SECRET_FILE",
            "Secret",
            "SecretError",
            "load_secret",
        )
    },
}

__all__ = [
    "ENV_SECRET",
    "ENV_SECRET_FILE",
    "LOOPBACK",
    "BytesLike",
    "ChannelError",
    "ChannelTimeoutError",
    "Connection",
    "DropReason",
    "Limits",
    "Listener",
    "Message",
    "PeerId",
    "Secret",
    "SecretError",
    "__version__",
    "load_secret",
]

__version__ = "0.1.0"  # the one source of the distribution's version (pyproject reads it)

# Hidden from type checkers, which then check every imported name against the table above.
if not TYPE_CHECKING:
    __getattr__ = lazy_getattr(__name__, _LAZY)
