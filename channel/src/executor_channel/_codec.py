"""Serialisation of calls and replies: pickle protocol 5 with out-of-band buffers.

CPU tensors, numpy arrays and large ``bytes`` (arguments and results, and items of small
tuples, lists and dicts in them) are not copied into the pickle stream: their memory travels as
separate out-of-band buffers that the ring copies once into shared memory. The receiver either
copies each once out of it into memory it owns (large buffers into warm memory of the receive
buffer cache, ``_buffers``, which reuses a block only once nothing refers to it), or, given a
:class:`pickle.PickleBuffer`, uses them in place: memory the receiver owns, or a worker's
private view of its call's slot (``_slot_views``), which the ring does not reuse while
anything built on it lives. Everything else is ordinary pickle.

A frame is ``header | buffer lengths | pickle bytes | buffers``. The header carries the
message kind, rank and sequence number, so a reply whose body cannot be unpickled is still
attributed to its call.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
from typing import Any

from . import _buffers
from ._ring_reader import Assembled
from ._ring_writer import STREAM_CHUNK

__all__ = [
    "KIND_CALL",
    "KIND_READY",
    "KIND_REPLY",
    "KIND_STOP",
    "OOB_BYTES_THRESHOLD",
    "DecodeError",
    "Frame",
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

#: kind (u8), ok (u8), rank or reply rank (i32, -1 for none), sequence number (u64),
#: number of out-of-band buffers (u32), pickle length (u64).
_HEADER = struct.Struct("<BBxxiQIQ")
_LENGTH = struct.Struct("<Q")
#: Set in a buffer's length word when a third-party reducer made it: such a buffer may be
#: kept by the object it rebuilds, so the receiver hands it a private copy.
_FOREIGN = 1 << 63
#: Set in a buffer's length word when it rebuilds a ``bytes`` object: a receiver assembling a
#: large message copies such a buffer straight into the ``bytes`` it becomes.
_BYTES = 1 << 62
_LENGTH_BITS = _BYTES - 1
#: ``bytes`` at least this large travel out of band. Smaller ones go in the pickle: copying
#: them there costs less than this module's out-of-band path in Python, while a much larger
#: pickle is built in fresh memory each call and costs more (figures: docs/benchmarks.md,
#: "Calls read in place").
OOB_BYTES_THRESHOLD = 128 << 10
#: Containers longer than this are not searched for large ``bytes`` (keeps encoding O(1)).
_SCAN_LIMIT = 64

#: An encoded frame: the parts to copy back to back, and their total bytes.
Frame = tuple[list[Any], int]


class _Bulk:
    """Wraps large ``bytes`` so that pickle sends them out of band."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def _rebuild_bytes(view: memoryview | pickle.PickleBuffer | bytes) -> bytes:
    if type(view) is bytes:  # assembled straight into its object (see plan_assembly)
        return view
    # A ``bytes`` object holds its data inline: a large one is allocated warm by the cache.
    return _buffers.cache.take_bytes(view)


def _private(view: memoryview | pickle.PickleBuffer) -> Any:
    """Memory the rebuilt object may keep: ``view`` itself when it is already the receiver's
    own (a :class:`pickle.PickleBuffer`, see :func:`decode`), else a copy out of the ring.

    The copy is writable (torch warns on read-only buffers) and kept alive by the tensor or
    array built on it. A large one goes into warm memory from the receive buffer cache
    (fresh pages would cost more than the copy; the cache reuses a block only once nothing
    refers to it), a small one into a ``bytearray``.
    """
    if type(view) is pickle.PickleBuffer:
        return view
    cache = _buffers.cache
    if view.nbytes < cache.min_bytes:
        return bytearray(view)
    copy = cache.take(view.nbytes)
    copy[:] = view
    return copy


def _rebuild_tensor(
    view: memoryview | pickle.PickleBuffer, dtype_name: str, shape: tuple[int, ...]
) -> Any:
    import torch  # the sender had torch, so this process is expected to have it too

    dtype = getattr(torch, dtype_name)
    if memoryview(view).nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(_private(view), dtype=torch.uint8).view(dtype).reshape(shape)


def _rebuild_ndarray(
    view: memoryview | pickle.PickleBuffer, dtype: Any, shape: tuple[int, ...], order: str
) -> Any:
    import numpy

    flat = numpy.frombuffer(_private(view), dtype=dtype)
    return flat.reshape(shape, order=order)  # type: ignore[call-overload]  # order is "C"/"F"


def _wrap_bulk(obj: Any, depth: int = 3) -> Any:
    """``obj`` with large bytes wrapped: itself, or inside tuples, lists and dicts of at
    most ``_SCAN_LIMIT`` items, ``depth`` levels down (a call's body is ``(method, args,
    kwargs)``, so depth 3 reaches a list inside an argument)."""
    kind = type(obj)
    if kind is bytes:
        return _Bulk(obj) if len(obj) >= OOB_BYTES_THRESHOLD else obj
    if depth == 0:
        return obj
    if kind is tuple or kind is list:
        if len(obj) > _SCAN_LIMIT:
            return obj
        items = [_wrap_bulk(item, depth - 1) for item in obj]
        if all(new is old for new, old in zip(items, obj, strict=True)):
            return obj
        return kind(items)
    if kind is dict:
        if len(obj) > _SCAN_LIMIT:
            return obj
        values = {key: _wrap_bulk(value, depth - 1) for key, value in obj.items()}
        if all(values[key] is value for key, value in obj.items()):
            return obj
        return values
    return obj


class _Pickler(pickle.Pickler):
    """Pickler whose own reducers send bulk memory out of band (see module docstring)."""

    def __init__(self, stream: io.BytesIO) -> None:
        self.buffers: list[pickle.PickleBuffer] = []
        self.mine: set[int] = set()
        self.bulk: set[int] = set()
        super().__init__(stream, protocol=5, buffer_callback=self.buffers.append)
        self._tensor_type: type | None = None
        self._ndarray_type: type | None = None

    def _own(self, data: Any) -> pickle.PickleBuffer:
        buffer = pickle.PickleBuffer(data)
        self.mine.add(id(buffer))
        return buffer

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is _Bulk:
            buffer = self._own(obj.data)
            self.bulk.add(id(buffer))
            return _rebuild_bytes, (buffer,)
        if self._tensor_type is None and "torch" in sys.modules:
            self._tensor_type = getattr(sys.modules["torch"], "Tensor", None)
        if kind is self._tensor_type:
            return self._reduce_tensor(obj)
        if self._ndarray_type is None and "numpy" in sys.modules:
            self._ndarray_type = getattr(sys.modules["numpy"], "ndarray", None)
        if kind is self._ndarray_type:
            return self._reduce_ndarray(obj)
        return NotImplemented

    def _reduce_tensor(self, tensor: Any) -> Any:
        if (
            tensor.device.type != "cpu"
            or tensor.requires_grad
            or tensor.is_sparse
            or tensor.is_quantized
            or tensor.is_nested
        ):
            return NotImplemented  # torch's own pickling handles these
        flat = tensor.resolve_conj().resolve_neg().contiguous().reshape(-1)
        dtype = str(tensor.dtype).removeprefix("torch.")
        if flat.numel() == 0:
            data: Any = b""
        else:
            import torch  # already imported: we hold a tensor

            data = flat.view(torch.uint8).numpy()
        return _rebuild_tensor, (self._own(data), dtype, tuple(tensor.shape))

    def _reduce_ndarray(self, array: Any) -> Any:
        if array.dtype.hasobject:
            return NotImplemented
        if array.flags.c_contiguous:
            order = "C"
        elif array.flags.f_contiguous:
            order = "F"
        else:
            return NotImplemented  # numpy pickles a contiguous copy in band
        return _rebuild_ndarray, (self._own(array), array.dtype, array.shape, order)


_SCALARS = frozenset({int, float, str, bool, type(None)})


def _plain(obj: Any, depth: int = 2) -> bool:
    """True if ``obj`` certainly pickles the same without our reducers (a fast path)."""
    kind = type(obj)
    if kind in _SCALARS:
        return True
    if kind is bytes:
        return len(obj) < OOB_BYTES_THRESHOLD
    if depth == 0:
        return False
    if kind is tuple or kind is list:
        return len(obj) <= 8 and all(_plain(item, depth - 1) for item in obj)
    if kind is dict:
        return len(obj) <= 8 and all(
            type(k) is str and _plain(v, depth - 1) for k, v in obj.items()
        )
    return False


#: ``None`` pickled once: most replies (and every no-op's) are ``None``.
_PICKLED_NONE = pickle.dumps(None, protocol=5)


def encode(kind: int, ok: bool, rank: int, seq: int, body: Any) -> Frame:
    """Encode ``body`` behind a header. Bulk buffers are referenced, not copied."""
    if body is None or type(body) in _SCALARS or _plain(body):
        data: Any = _PICKLED_NONE if body is None else pickle.dumps(body, protocol=5)
        head = _HEADER.pack(kind, ok, rank, seq, 0, len(data))
        return [head, data], len(head) + len(data)
    stream = io.BytesIO()
    pickler = _Pickler(stream)
    pickler.dump(_wrap_bulk(body))
    data = stream.getbuffer()
    buffers = pickler.buffers
    head_buf = bytearray(_HEADER.size + _LENGTH.size * len(buffers))
    _HEADER.pack_into(head_buf, 0, kind, ok, rank, seq, len(buffers), len(data))
    parts: list[Any] = [head_buf, data]
    nbytes = len(head_buf) + len(data)
    offset = _HEADER.size
    for buffer in buffers:
        raw = buffer.raw()
        flags = 0 if id(buffer) in pickler.mine else _FOREIGN
        if id(buffer) in pickler.bulk:
            flags |= _BYTES
        _LENGTH.pack_into(head_buf, offset, raw.nbytes | flags)
        offset += _LENGTH.size
        parts.append(raw)
        nbytes += raw.nbytes
    return parts, nbytes


#: Pickled ``(method, (), {})`` by method name: a call without arguments is a header away.
_BARE_CALLS: dict[str, bytes] = {}
_BARE_CALLS_MAX = 256


def encode_call(reply_rank: int, seq: int, method: str | bytes, args: Any, kwargs: Any) -> Frame:
    """Encode a call (``encode`` with a fast path for calls without arguments)."""
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
    its first part (which starts with the header and buffer lengths): true when none of its
    out-of-band buffers rebuilds a tensor or an array, which a worker builds in place (each
    rebuilds ``bytes``, which owns a copy of its data, or there are none). The ring may then
    stream it (:meth:`RingWriter.write <._ring_writer.RingWriter.write>`'s ``copied``); a
    frame of at most :data:`~._ring_writer.STREAM_CHUNK` is written whole either way, and is
    not looked at."""
    if nbytes <= STREAM_CHUNK:
        return False
    count = _HEADER.unpack_from(first, 0)[4]
    return all(
        _LENGTH.unpack_from(first, _HEADER.size + _LENGTH.size * i)[0] & _BYTES
        for i in range(count)
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
        word & _BYTES and word & _LENGTH_BITS >= cache.min_bytes for word in words
    ):
        return None
    head = bytearray(front + pickle_len)
    dests = [memoryview(head)]
    parts: list[Any] = [head]
    for word in words:
        length = word & _LENGTH_BITS
        made = cache.new_bytes(length) if word & _BYTES and length >= cache.min_bytes else None
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
        views.append(part if type(part) is bytes or word & _FOREIGN else pickle.PickleBuffer(part))
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
    one slot as its private view of the slot, :meth:`~._ring_reader.RingReader.read_held`):
    its buffers are used in place, so a large payload is not copied twice; so are the pieces
    of an
    :class:`~._ring_reader.Assembled` frame (see :func:`plan_assembly`).
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
                views.append(view if word & _FOREIGN else pickle.PickleBuffer(view))
            else:
                views.append(bytearray(view) if word & _FOREIGN else view)
            offset += length
        return kind, ok, rank, seq, pickle.loads(data, buffers=views)
    except Exception as exc:
        raise DecodeError(kind, bool(ok), rank, seq, exc) from exc
