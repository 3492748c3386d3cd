"""Frames of calls and replies: a header, then a body pickled with bulk memory out of band.

A frame is ``header | buffer lengths | pickle bytes | buffers``. The header carries the
message kind, rank and sequence number, so a reply whose body cannot be unpickled is still
attributed to its call. Each buffer's length word carries its flags (:data:`FOREIGN`,
:data:`BYTES`), which tell a receiver how it may use the buffer's memory.

The body: pickle protocol 5. CPU tensors, numpy arrays and large ``bytes`` (the body itself,
and items of small tuples, lists and dicts in it) are not copied into the pickle stream: their
memory travels as separate out-of-band buffers, each with flags written into the frame. The
receiver either copies each once into memory it owns (large buffers into warm memory of the
receive buffer cache, ``_buffers``, which reuses a block only once nothing refers to it), or,
given a :class:`pickle.PickleBuffer`, uses them in place: memory the receiver owns, or a
worker's private view of its call's slot (``_slot_views``), which the ring does not reuse while
anything built on it lives. Everything else is ordinary pickle.
"""

from __future__ import annotations

import copyreg
import pickle
import struct
import sys
import threading
from typing import Any

from ._memory import buffers as _buffers

__all__ = [
    "BYTES",
    "FOREIGN",
    "KIND_CALL",
    "KIND_READY",
    "KIND_REPLY",
    "KIND_STOP",
    "OOB_BYTES_THRESHOLD",
    "SCALARS",
    "STREAM_CHUNK",
    "Assembled",
    "DecodeError",
    "Frame",
    "Kind",
    "copied_whole",
    "decode",
    "dumps",
    "encode",
    "encode_call",
    "plan_assembly",
    "scan",
]

#: A message that its readers copy out (one larger than a slot, or one the writer says is
#: ``copied``) is streamed in chunks of at most this size: each reader copies one chunk
#: while the next is written, instead of starting once the whole message is in. Smaller
#: chunks overlap more and cost more wake-ups (figures: docs/benchmarks.md, "Calls read in
#: place").
STREAM_CHUNK = 4 << 20


class Assembled:
    """A message of several slots that the reader copied into several pieces of memory it
    owns, as the ``assemble`` function given to :meth:`Ring.read <._shm.ring.Ring.read>`
    placed them; ``parts`` is what that function made of them (see :func:`plan_assembly`)."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[object]) -> None:
        self.parts = parts


#: Set in a buffer's length word when a third-party reducer made it: such a buffer may be
#: kept by the object it rebuilds, so the receiver hands it a private copy.
FOREIGN = 1 << 63

#: Set in a buffer's length word when it rebuilds a ``bytes`` object: a receiver assembling a
#: large message copies such a buffer straight into the ``bytes`` it becomes.
BYTES = 1 << 62

#: ``bytes`` at least this large travel out of band. Smaller ones go in the pickle: copying
#: them there costs less than this module's out-of-band path in Python, while a much larger
#: pickle is built in fresh memory each call and costs more (figures: docs/benchmarks.md,
#: "Calls read in place").
OOB_BYTES_THRESHOLD = 128 << 10

#: Containers longer than this are not searched for large ``bytes`` (keeps encoding O(1)).
_SCAN_LIMIT = 64


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
    own (a :class:`pickle.PickleBuffer`, see :func:`._codec.decode`), else a copy out of the ring.

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
    flat = torch.frombuffer(_private(view), dtype=dtype)
    return flat if len(shape) == 1 else flat.view(shape)


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


#: torch dtypes that numpy has too, by dtype: a tensor of one is handed over as ``numpy()``
#: gives it (filled on first use; torch is imported only by a process that sends tensors).
_NUMPY_DTYPES: dict[Any, str] = {}

_NUMPY_DTYPE_NAMES = (
    *("float64", "float32", "float16", "complex128", "complex64"),
    *("int64", "int32", "int16", "int8", "uint8", "bool"),
)


def _numpy_dtypes(torch: Any) -> dict[Any, str]:
    if not _NUMPY_DTYPES:
        for name in _NUMPY_DTYPE_NAMES:
            _NUMPY_DTYPES[getattr(torch, name)] = name
    return _NUMPY_DTYPES


class _Reducers(dict[type, Any]):
    """A pickler's ``dispatch_table``: this module's reducers by type, then copyreg's (read at
    each lookup, so that a reducer registered later is found)."""

    def __missing__(self, kind: type) -> Any:
        return copyreg.dispatch_table[kind]  # KeyError: the pickler asks the object itself


class _Pickler(pickle.Pickler):
    """Pickler whose own reducers send bulk memory out of band (see module docstring).

    They are found through its ``dispatch_table``, a lookup by type in C (a
    ``reducer_override`` would be called in Python for every object that is not a plain
    container or scalar, the reducers' own results included). One per thread is reused
    (:meth:`current`): making a pickler costs more than most calls' pickling. It writes to
    itself (:meth:`write`), so that what it wrote can be taken as it is, without a copy."""

    _local = threading.local()

    def __init__(self) -> None:
        self.out: list[Any] = []
        self.buffers: list[pickle.PickleBuffer] = []
        self.mine: set[int] = set()
        self.bulk: set[int] = set()
        self.busy = False
        self._table = _Reducers({_Bulk: self._reduce_bulk})
        self._numpy_dtypes: dict[Any, str] = {}
        self.dispatch_table = self._table  # read by the C pickler in __init__: set it first
        super().__init__(self, protocol=5, buffer_callback=self.buffers.append)

    @classmethod
    def current(cls) -> _Pickler:
        """This thread's pickler, or a new one if it is in use (a reducer that encodes)."""
        pickler: _Pickler | None = getattr(cls._local, "pickler", None)
        if pickler is None:
            pickler = cls._local.pickler = cls()
        elif pickler.busy:
            return cls()
        table = pickler._table
        if len(table) < 3:  # torch or numpy may have been imported since
            modules = sys.modules
            if "torch" in modules:
                torch = modules["torch"]
                table[torch.Tensor] = pickler._reduce_tensor
                pickler._numpy_dtypes = _numpy_dtypes(torch)
            if "numpy" in modules:
                table[modules["numpy"].ndarray] = pickler._reduce_ndarray
        return pickler

    def write(self, data: Any) -> int:
        """Where the pickle goes: kept as written (the C pickler hands over whole frames, and
        large in-band ``bytes`` as the objects themselves)."""
        self.out.append(data)
        return len(data)

    def run(self, body: Any) -> tuple[list[Any], list[tuple[memoryview, int]]]:
        """Pickle ``body``: the pickle's pieces, and each out-of-band buffer with its flags."""
        self.busy = True
        mine, bulk = self.mine, self.bulk
        try:
            self.dump(body)
            buffers = []
            for buffer in self.buffers:
                flags = 0 if id(buffer) in mine else FOREIGN
                if id(buffer) in bulk:
                    flags |= BYTES
                buffers.append((buffer.raw(), flags))
            return self.out, buffers
        finally:
            self.clear_memo()
            self.out = []
            self.buffers.clear()
            mine.clear()
            bulk.clear()
            self.busy = False

    def _own(self, data: Any) -> pickle.PickleBuffer:
        buffer = pickle.PickleBuffer(data)
        self.mine.add(id(buffer))
        return buffer

    def _reduce_bulk(self, obj: _Bulk) -> Any:
        buffer = self._own(obj.data)
        self.bulk.add(id(buffer))
        return _rebuild_bytes, (buffer,)

    def _reduce_tensor(self, tensor: Any) -> Any:
        name = self._numpy_dtypes.get(tensor.dtype)
        if name is not None:
            # A dense CPU tensor without grad, conjugate or negative bit: numpy() shares its
            # memory and refuses every other kind (caught below), with no copy.
            try:
                data: Any = tensor.numpy()
            except (RuntimeError, TypeError):
                pass
            else:
                if data.flags.c_contiguous:
                    return _rebuild_tensor, (self._own(data), name, tuple(tensor.shape))
        if (
            tensor.device.type != "cpu"
            or tensor.requires_grad
            or tensor.is_sparse
            or tensor.is_quantized
            or tensor.is_nested
        ):
            return tensor.__reduce_ex__(5)  # torch's own pickling handles these
        flat = tensor.resolve_conj().resolve_neg().contiguous().reshape(-1)
        dtype = str(tensor.dtype).removeprefix("torch.")
        if flat.numel() == 0:
            data = b""
        else:
            import torch  # already imported: we hold a tensor

            data = flat.view(torch.uint8).numpy()
        return _rebuild_tensor, (self._own(data), dtype, tuple(tensor.shape))

    def _reduce_ndarray(self, array: Any) -> Any:
        dtype = array.dtype
        if dtype.hasobject:
            return array.__reduce_ex__(5)
        if array.flags.c_contiguous:
            order = "C"
        elif array.flags.f_contiguous:
            order = "F"
        else:
            return array.__reduce_ex__(5)  # numpy pickles a contiguous copy in band
        try:
            buffer = self._own(array)
        except ValueError:  # no buffer of its dtype (datetimes): numpy pickles it
            return array.__reduce_ex__(5)
        # A built-in dtype travels as its one-letter code: pickling the dtype object costs
        # more than the rest of the array's reduction.
        code = dtype.char if dtype.isbuiltin == 1 else dtype
        return _rebuild_ndarray, (buffer, code, array.shape, order)


#: Types that pickle the same with or without this module's reducers.
SCALARS = frozenset({int, float, str, bool, type(None)})

_CONTAINERS = frozenset({tuple, list, dict})

#: What :func:`scan` finds a body needs: this module's pickler (something other than scalars
#: and small ``bytes``, or not looked at), and large ``bytes`` wrapped for it (:func:`_wrap_bulk`).
_PICKLER = 1

_BULK = 2


def scan(obj: Any, depth: int = 3) -> int:
    """What encoding ``obj`` needs: 0 if it certainly pickles the same without this module's
    reducers (scalars, small ``bytes``, and tuples, lists and dicts of them, looked at
    whole); else :data:`_PICKLER`, with :data:`_BULK` if it holds a large ``bytes`` where
    :func:`_wrap_bulk` (the same depth and limits) wraps it. One pass, so that a call with a
    tensor is looked at once, not once for each question."""
    kind = type(obj)
    if kind in SCALARS:
        return 0
    if kind is bytes:
        return _PICKLER | _BULK if len(obj) >= OOB_BYTES_THRESHOLD else 0
    if kind not in _CONTAINERS or depth == 0 or len(obj) > _SCAN_LIMIT:
        return _PICKLER
    need = 0
    scalars = SCALARS
    if kind is dict:
        for key, value in obj.items():
            if type(key) not in scalars:
                need |= _PICKLER
            if type(value) not in scalars:
                need |= scan(value, depth - 1)
    else:
        for item in obj:
            if type(item) not in scalars:
                need |= scan(item, depth - 1)
    return need


def dumps(body: Any, need: int) -> tuple[list[Any], list[tuple[memoryview, int]]]:
    """``body`` pickled, given what :func:`scan` found it needs (not 0): the pickle's pieces,
    and each out-of-band buffer (referenced, not copied) with its flags."""
    return _Pickler.current().run(_wrap_bulk(body) if need & _BULK else body)


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
    """A frame's kind, :func:`encode`'s first argument (``KIND_*`` above say what each holds)."""

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
    stream it (:meth:`Ring.write <._shm.ring.Ring.write>`'s ``copied``); a
    frame of at most :data:`STREAM_CHUNK` is written whole either way, and is
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
    first chunk (``assemble`` of :meth:`Ring.read <._shm.ring.Ring.read>`): the header and pickle
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
    one slot as its private view of the slot, :meth:`~._shm.ring.Ring.read_held`):
    its buffers are used in place, so a large payload is not copied twice; so are the pieces
    of an
    :class:`Assembled` frame (see :func:`plan_assembly`).
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
