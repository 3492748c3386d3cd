"""The vocabulary of a link's signatures: who a message is from, what its parts may be, the
:class:`Message` a link delivers and the errors its operations raise."""

from __future__ import annotations

import pickle
from typing import NewType

import attrs

__all__ = [
    "BytesLike",
    "ChannelError",
    "ChannelTimeoutError",
    "Message",
    "PeerId",
]

#: Identifies the other end of a session: the dialer's session id at a listener, the
#: listener's epoch id at a connection. Opaque bytes.
PeerId = NewType("PeerId", bytes)

#: What a message part may be: anything exposing a C-contiguous buffer.
BytesLike = bytes | bytearray | memoryview | pickle.PickleBuffer


class ChannelError(Exception):
    """A link operation failed (closed link, unknown or unreachable peer, bind failure)."""


class ChannelTimeoutError(ChannelError, TimeoutError):
    """A send, receive or handshake did not complete within its timeout."""


@attrs.frozen
class Message:
    """An authenticated message: who sent it and its parts.

    The parts are zero-copy views of the received zmq frames; they stay valid as long as
    they are referenced.
    """

    peer: PeerId
    parts: tuple[memoryview, ...]
