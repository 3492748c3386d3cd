"""The channel's one codec: pickle protocol 5 with out-of-band buffers.

CPU tensors, numpy arrays and large ``bytes`` travel beside the pickle stream, never through
torch's pickle reducer; a frame is a list of bytes-like parts that a :mod:`~executor_channel.shm`
ring or a network link carries as they are. See :func:`encode` and :func:`decode`;
:func:`encode_call` makes a call's frame (what :meth:`Hub.broadcast
<executor_channel.hub.Hub.broadcast>` sends).
"""

from __future__ import annotations

from ._codec import (
    KIND_READY,
    KIND_STOP,
    DecodeError,
    Frame,
    copied_whole,
    decode,
    encode,
    encode_call,
)

__all__ = [
    "KIND_READY",
    "KIND_STOP",
    "DecodeError",
    "Frame",
    "copied_whole",
    "decode",
    "encode",
    "encode_call",
]
