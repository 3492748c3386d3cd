"""executor-channel: authenticated message links between the nodes of an Executor SDK job.

A :class:`Listener` (zmq ROUTER, on loopback unless told otherwise) and the
:class:`Connection` objects that dial it exchange messages made of bytes-like parts. Every
frame is signed with HMAC-SHA256 under a shared :class:`Secret` and checked (structure,
lengths, MAC, freshness) before the caller sees a byte of it; frames that fail are dropped,
counted per :class:`DropReason` and logged once per peer. The link never unpickles: callers
decode the parts they are handed. Frames are authenticated, not encrypted; see
``docs/security.md`` for the threat model.
"""

from __future__ import annotations

from ._frames import DropReason, Limits
from ._link import (
    LOOPBACK,
    BytesLike,
    ChannelError,
    ChannelTimeoutError,
    Connection,
    Listener,
    Message,
    PeerId,
)
from ._secret import (
    ENV_SECRET,
    ENV_SECRET_FILE,
    MIN_SECRET_BYTES,
    Secret,
    SecretError,
    load_secret,
)

__all__ = [
    "ENV_SECRET",
    "ENV_SECRET_FILE",
    "LOOPBACK",
    "MIN_SECRET_BYTES",
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

__version__ = "0.1.0"  # keep equal to pyproject.toml
