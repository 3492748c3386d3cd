"""Frames of calls and replies: a header, then a body pickled by :mod:`._pickling`.

A frame is ``header | buffer lengths | pickle bytes | buffers``. The header carries the
message kind, rank and sequence number, so a reply whose body cannot be unpickled is still
attributed to its call. Each buffer's length word carries its flags (:data:`._pickling.FOREIGN`,
:data:`._pickling.BYTES`), which tell a receiver how it may use the buffer's memory.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any

from . import _buffers
from ._pickling import BYTES, FOREIGN, OOB_BYTES_THRESHOLD, SCALARS, dumps, scan
from ._ring import STREAM_CHUNK, Assembled

__all__ = [
    "KIND_CALL",
    "KIND_READY",
    "KIND_REPLY",
    "KIND_STOP",
    "OOB_BYTES_THRESHOLD",
    "DecodeError",
    "Frame",
    "Kind",
    "copied_whole",
    "decode",
    "encode",
    "encode_call",
    "plan_assembly",
]

#: A frame's kind: a call to the workers (its body is ``(method, args, kwargs)``).
KIND_CALL = 1
#: A frame's kind: the stop message; a worker that reads it stops serving.
KIND_STOP = 2
#: A frame's kind: a worker is ready for calls (its body is its process id), or could not start
#: (not ok: its body is why).
KIND_READY = 3
#: A frame's kind: a worker's answer to a call (its body is the result or the failure).
KIND_REPLY = 4


class Kind:
    """A frame's kinds, as a backend's workers send them (:func:`encode`'s first argument):
    :attr:`READY` (a worker is ready for calls, its body its process id; not ok: why it could
    not start) and :attr:`STOP` (the stop message); calls and replies are the channel's."""

    CALL = KIND_CALL
    STOP = KIND_STOP
    READY = KIND_READY
    REPLY = KIND_REPLY


#: kind (u8), ok (u8), rank or reply rank (i32, -1 for none), sequence number (u64),
#: number of out-of-band buffers (u32), pickle length (u64).
_HEADER = struct.Struct("<BBxxiQIQ")
_LENGTH = struct.Struct("<Q")
_LENGTH_BITS = BYTES - 1

#: An encoded frame: the parts to copy back to back, and their total bytes.
Frame = tuple[list[Any], int]


#: ``None`` pickled once: most replies (and every no-op's) are ``None``.
_PICKLED_NONE = pickle.dumps(None, protocol=5)


def encode(kind: int, ok: bool, rank: int, seq: int, body: Any) -> Frame:
    """Encode ``body`` behind a header. Bulk buffers are referenced, not copied."""
    need = 0 if body is None or type(body) in SCALARS else scan(body)
    if not need:
        data = _PICKLED_NONE if body is None else pickle.dumps(body, protocol=5)
        head = _HEADER.pack(kind, ok, rank, seq, 0, len(data))
        return [head, data], len(head) + len(data)
    pieces, buffers = dumps(body, need)
    pickle_len = sum(len(piece) for piece in pieces)
    head_buf = bytearray(_HEADER.size + _LENGTH.size * len(buffers))
    _HEADER.pack_into(head_buf, 0, kind, ok, rank, seq, len(buffers), pickle_len)
    parts: list[Any] = [head_buf, *pieces]
    nbytes = len(head_buf) + pickle_len
    offset = _HEADER.size
    for raw, flags in buffers:
        _LENGTH.pack_into(head_buf, offset, raw.nbytes | flags)
        offset += _LENGTH.size
        parts.append(raw)
        nbytes += raw.nbytes
    return parts, nbytes


#: Pickled ``(method, (), {})`` by method name: a call without arguments is a header away.
_BARE_CALLS: dict[str, bytes] = {}
_BARE_CALLS_MAX = 256


def encode_call(reply_rank: int, seq: int, method: str | bytes, args: Any, kwargs: Any) -> Frame:
    """A call's frame: ``encode(KIND_CALL, True, reply_rank, seq, (method, args, kwargs))``,
    with a fast path for a call by name without arguments. ``reply_rank`` is the one rank that
    answers, or -1 for every rank; ``seq`` is the call's number."""
    if args or kwargs or type(method) is not str:
        return encode(KIND_CALL, True, reply_rank, seq, (method, args, kwargs or {}))
    data = _BARE_CALLS.get(method)
    if data is None:
        data = pickle.dumps((method, (), {}), protocol=5)
        if len(_BARE_CALLS) < _BARE_CALLS_MAX:
            _BARE_CALLS[method] = data
    head = _HEADER.pack(KIND_CALL, True, reply_rank, seq, 0, len(data))
    return [head, data], len(head) + len(data)


def copied_whole(first: Any, nbytes: int) -> bool:
    """Whether every worker copies all of a call's frame of ``nbytes`` out of the ring, given
    its first part (which starts with the header and buffer lengths; false if it holds less
    than those): true when none of its
    out-of-band buffers rebuilds a tensor or an array, which a worker builds in place (each
    rebuilds ``bytes``, which owns a copy of its data, or there are none). The ring may then
    stream it (:meth:`Ring.write <._ring.Ring.write>`'s ``copied``); a
    frame of at most :data:`~._ring.STREAM_CHUNK` is written whole either way, and is
    not looked at."""
    if nbytes <= STREAM_CHUNK or len(first) < _HEADER.size:
        return False
    count = _HEADER.unpack_from(first, 0)[4]
    if len(first) < _HEADER.size + _LENGTH.size * count:  # the lengths go on past ``first``
        return False
    return all(
        _LENGTH.unpack_from(first, _HEADER.size + _LENGTH.size * i)[0] & BYTES for i in range(count)
    )


class DecodeError(Exception):
    """A frame's body could not be unpickled; carries the header for attribution."""

    def __init__(self, kind: int, ok: bool, rank: int, seq: int, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.kind, self.ok, self.rank, self.seq, self.cause = kind, ok, rank, seq, cause


def plan_assembly(first: memoryview, nbytes: int) -> tuple[list[memoryview], Assembled] | None:
    """Where a reader copies a frame of ``nbytes`` that spans several ring slots, given its
    first chunk (``assemble`` of :meth:`Ring.read <._ring.Ring.read>`): the header and pickle
    into a ``bytearray``, each large ``bytes`` buffer straight into the ``bytes`` object it
    becomes (one copy instead of two), other buffers into blocks of the buffer cache. None (one
    block for the whole frame) unless the frame carries a large ``bytes``, or if the first
    chunk does not hold the frame's buffer lengths or they do not add up to ``nbytes``.
    """
    if len(first) < _HEADER.size:
        return None
    count, pickle_len = _HEADER.unpack_from(first, 0)[4:]
    front = _HEADER.size + _LENGTH.size * count
    if not count or front > len(first):
        return None
    cache = _buffers.cache
    words = [_LENGTH.unpack_from(first, _HEADER.size + _LENGTH.size * i)[0] for i in range(count)]
    if front + pickle_len + sum(word & _LENGTH_BITS for word in words) != nbytes or not any(
        word & BYTES and word & _LENGTH_BITS >= cache.min_bytes for word in words
    ):
        return None
    head = bytearray(front + pickle_len)
    dests = [memoryview(head)]
    parts: list[Any] = [head]
    for word in words:
        length = word & _LENGTH_BITS
        made = cache.new_bytes(length) if word & BYTES and length >= cache.min_bytes else None
        if made is not None:
            parts.append(made[0])
            dests.append(made[1])
        elif length:
            view = cache.take(length)
            parts.append(view)
            dests.append(view)
        else:
            parts.append(memoryview(b""))
    return dests, Assembled(parts)


def _decode_assembled(parts: list[Any]) -> tuple[int, bool, int, int, Any]:
    head = parts[0]
    kind, ok, rank, seq, count, pickle_len = _HEADER.unpack_from(head, 0)
    offset = _HEADER.size + _LENGTH.size * count
    views: list[Any] = []
    for i, part in enumerate(parts[1:]):
        word = _LENGTH.unpack_from(head, _HEADER.size + _LENGTH.size * i)[0]
        # The reader's own memory, as for a PickleBuffer frame in decode.
        views.append(part if type(part) is bytes or word & FOREIGN else pickle.PickleBuffer(part))
    try:
        data = memoryview(head)[offset : offset + pickle_len]
        return kind, ok, rank, seq, pickle.loads(data, buffers=views)
    except Exception as exc:
        raise DecodeError(kind, bool(ok), rank, seq, exc) from exc


def decode(buf: memoryview | pickle.PickleBuffer | Assembled) -> tuple[int, bool, int, int, Any]:
    """``(kind, ok, rank, seq, body)`` of a frame. Raises :class:`DecodeError` if the body
    cannot be unpickled.

    A frame in a memoryview (a view of a ring slot, reused once read) is copied out of: each
    out-of-band buffer once, into memory the object it rebuilds owns. A frame in a
    :class:`pickle.PickleBuffer` is memory the receiver may keep (the ring hands a message
    that spanned several slots that way, after copying it out once, and a worker's call of
    one slot as its private view of the slot, :meth:`~._ring.Ring.read_held`):
    its buffers are used in place, so a large payload is not copied twice; so are the pieces
    of an
    :class:`~._ring.Assembled` frame (see :func:`plan_assembly`).
    """
    if isinstance(buf, Assembled):
        return _decode_assembled(buf.parts)
    owned = False
    if isinstance(buf, pickle.PickleBuffer):
        owned, buf = True, buf.raw()
    kind, ok, rank, seq, count, pickle_len = _HEADER.unpack_from(buf, 0)
    offset = _HEADER.size + _LENGTH.size * count
    data = buf[offset : offset + pickle_len]
    try:
        if not count:
            return kind, ok, rank, seq, pickle.loads(data)
        offset += pickle_len
        views: list[Any] = []
        for i in range(count):
            word = _LENGTH.unpack_from(buf, _HEADER.size + _LENGTH.size * i)[0]
            length = word & _LENGTH_BITS
            view = buf[offset : offset + length]
            if owned:
                views.append(view if word & FOREIGN else pickle.PickleBuffer(view))
            else:
                views.append(bytearray(view) if word & FOREIGN else view)
            offset += length
        return kind, ok, rank, seq, pickle.loads(data, buffers=views)
    except Exception as exc:
        raise DecodeError(kind, bool(ok), rank, seq, exc) from exc
