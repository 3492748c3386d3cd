"""A link's :class:`Limits`: bounds on what it accepts and queues."""

from __future__ import annotations

import attrs

__all__ = ["Limits"]


def _positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be at least 1, got {value}")


def _positive_seconds(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0 < value < float("inf"):
        raise ValueError(f"{attribute.name} must be a finite number of seconds > 0, got {value}")


@attrs.frozen
class Limits:
    """Bounds on what a link accepts and queues; a frame beyond them is dropped unread.

    Before a peer has passed the gate (:mod:`._gate`: zmq's handshake, in which it proves it
    holds the secret), zmq accepts no message from it: a connection can make this side hold
    at most one zmq part of at most ``chunk_bytes``, for at most ``handshake_s``, and at most
    ``max_pending`` connections are kept in that state at once. After the gate, zmq refuses
    any part above ``chunk_bytes`` (and disconnects its sender) and queues at most ``hwm``
    messages each way; the link drops a message whose parts exceed ``max_parts`` or
    ``max_part_bytes``. Both ends of a link should use the same limits: a part above the
    receiver's ``chunk_bytes`` costs the sender its connection.
    """

    #: Most payload parts in one message.
    max_parts: int = attrs.field(default=1024, validator=_positive)
    #: Largest payload part, in bytes (it may travel as several chunks).
    max_part_bytes: int = attrs.field(default=1 << 30, validator=_positive)
    #: zmq high-water mark (messages queued) for sending and for receiving.
    hwm: int = attrs.field(default=1000, validator=_positive)
    #: Most sessions a listener keeps (the least recently active goes first).
    max_peers: int = attrs.field(default=1024, validator=_positive)
    #: Largest zmq part sent or accepted: a longer payload part travels as several. It is
    #: what one connection that has not passed the gate can make a listener hold; a larger
    #: value saves the receiver one copy of parts up to that size.
    chunk_bytes: int = attrs.field(default=1 << 20, validator=_positive)
    #: How long a connection may take over zmq's handshake (the gate) before zmq drops it.
    handshake_s: float = attrs.field(default=10.0, validator=_positive_seconds)
    #: Most connections a listener keeps in zmq's handshake at once; newer ones are cut.
    max_pending: int = attrs.field(default=32, validator=_positive)
