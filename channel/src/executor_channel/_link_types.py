"""The vocabulary of a link's signatures: who a message is from, what its parts may be, the
:class:`Message` a link delivers and the errors its operations raise."""

from __future__ import annotations

import functools
import pickle
from typing import NewType

import attrs

from ._frames import Pieces, joined

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
    they are referenced. A part longer than the sender's chunk size arrives in several zmq
    parts (:attr:`chunks`); :attr:`parts` joins those on first use (one copy), so a receiver
    that only forwards a part (into shared memory, say) can take its chunks instead.
    """

    peer: PeerId
    #: Each part as the zmq parts it arrived in, in order (one view if it came whole).
    chunks: tuple[Pieces, ...]

    @functools.cached_property
    def parts(self) -> tuple[memoryview, ...]:
        """Each part as one buffer."""
        return tuple(joined(pieces) for pieces in self.chunks)
