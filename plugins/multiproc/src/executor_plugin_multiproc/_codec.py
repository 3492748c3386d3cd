"""Serialisation of calls and replies: pickle protocol 5 with out-of-band buffers.

Large ``bytes``, CPU tensors and numpy arrays are not copied into the pickle stream: their
memory is listed as separate buffers that the ring copies once into shared memory, and the
receiver copies once out of it into memory it owns (a received object never aliases the
ring, whose slots are reused). Everything else is ordinary pickle.

A frame is ``header | meta | buffer lengths | pickle bytes | buffers``. The fixed header
carries the message kind, rank and sequence number, so a reply whose body cannot be
unpickled is still attributed to its call.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
from collections.abc import Callable, Sequence
from typing import Any

import attrs

__all__ = [
    "HEADER",
    "KIND_CALL",
    "KIND_READY",
    "KIND_REPLY",
    "KIND_STOP",
    "Frame",
    "Header",
    "decode_body",
    "encode",
    "read_header",
    "stamp_seq",
]

KIND_CALL = 1
KIND_STOP = 2
KIND_READY = 3
KIND_REPLY = 4

#: kind (u8), ok (u8), rank or reply rank (i32, -1 for none), sequence number (u64).
HEADER = struct.Struct("<BBxxiQ")
#: number of persistent-id buffers, number of pickle out-of-band buffers, pickle length.
_META = struct.Struct("<IIQ")
_LENGTH = struct.Struct("<Q")
#: ``bytes`` at least this large travel out of band.
OOB_BYTES_THRESHOLD = 4096


@attrs.frozen
class Header:
    """The fixed part of a message."""

    kind: int
    ok: bool
    rank: int
    seq: int


@attrs.frozen
class Frame:
    """An encoded message: parts to copy back to back, ``nbytes`` in all."""

    parts: tuple[memoryview, ...]
    nbytes: int


def _bytes_id(obj: bytes, buffers: list[memoryview]) -> tuple[Any, ...] | None:
    if len(obj) < OOB_BYTES_THRESHOLD:
        return None
    buffers.append(memoryview(obj))
    return ("b", len(buffers) - 1)


def _tensor_id(obj: Any, buffers: list[memoryview]) -> tuple[Any, ...] | None:
    if (
        obj.device.type != "cpu"
        or obj.requires_grad
        or obj.is_sparse
        or obj.is_quantized
        or obj.is_nested
    ):
        return None  # torch's own pickling handles these
    flat = obj.resolve_conj().resolve_neg().contiguous().reshape(-1)
    if flat.numel() == 0:
        raw = memoryview(b"")
    else:
        import torch  # already imported: obj is a tensor

        raw = memoryview(flat.view(torch.uint8).numpy())
    buffers.append(raw)
    dtype = str(obj.dtype).removeprefix("torch.")
    return ("t", len(buffers) - 1, dtype, tuple(obj.shape))


_ID_FUNCS: dict[type, Callable[[Any, list[memoryview]], tuple[Any, ...] | None]] = {
    bytes: _bytes_id
}
_torch_registered = False


def _register_torch() -> None:
    global _torch_registered
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "Tensor"):
        return
    _ID_FUNCS[torch.Tensor] = _tensor_id
    _torch_registered = True


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, buffers: list[memoryview], oob: list[Any]) -> None:
        super().__init__(file, protocol=5, buffer_callback=oob.append)
        self._buffers = buffers

    def persistent_id(self, obj: Any) -> Any:
        func = _ID_FUNCS.get(type(obj))
        if func is None:
            return None
        return func(obj, self._buffers)


def encode(kind: int, ok: bool, rank: int, seq: int, body: Any) -> Frame:
    """Encode ``body`` behind a header; bulk buffers are referenced, not copied."""
    if not _torch_registered:
        _register_torch()
    stream = io.BytesIO()
    buffers: list[memoryview] = []
    oob: list[pickle.PickleBuffer] = []
    _Pickler(stream, buffers, oob).dump(body)
    data = stream.getbuffer()
    raws = [memoryview(buf.raw()) for buf in oob]
    bulk = [*buffers, *raws]
    head = bytearray(HEADER.size + _META.size + _LENGTH.size * len(bulk))
    HEADER.pack_into(head, 0, kind, ok, rank, seq)
    _META.pack_into(head, HEADER.size, len(buffers), len(raws), len(data))
    offset = HEADER.size + _META.size
    for view in bulk:
        _LENGTH.pack_into(head, offset, view.nbytes)
        offset += _LENGTH.size
    parts = (memoryview(head), data, *(v.cast("B") if v.format != "B" else v for v in bulk))
    return Frame(parts, sum(p.nbytes for p in parts))


_SEQ = struct.Struct("<Q")
_SEQ_OFFSET = 8


def stamp_seq(frame: Frame, seq: int) -> None:
    """Set the sequence number of an encoded frame (assigned under the sender's lock)."""
    _SEQ.pack_into(frame.parts[0], _SEQ_OFFSET, seq)


def read_header(buf: memoryview) -> Header:
    """The fixed header of a frame."""
    kind, ok, rank, seq = HEADER.unpack_from(buf, 0)
    return Header(kind, bool(ok), rank, seq)


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: memoryview, buffers: Sequence[memoryview], oob: list[Any]) -> None:
        super().__init__(io.BytesIO(data), buffers=oob)
        self._buffers = buffers

    def persistent_load(self, pid: Any) -> Any:
        kind = pid[0]
        if kind == "b":
            return bytes(self._buffers[pid[1]])
        if kind == "t":
            return _load_tensor(self._buffers[pid[1]], pid[2], pid[3])
        raise pickle.UnpicklingError(f"unknown out-of-band reference {pid!r}")


def _load_tensor(view: memoryview, dtype_name: str, shape: tuple[int, ...]) -> Any:
    import torch  # the sender had torch, so this process is expected to have it too

    dtype = getattr(torch, dtype_name)
    if view.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    # ``bytearray`` makes the one copy out of shared memory and is writable (torch warns on
    # read-only buffers); the tensor keeps it alive.
    owned = torch.frombuffer(bytearray(view), dtype=torch.uint8)
    return owned.view(dtype).reshape(shape)


def decode_body(buf: memoryview) -> Any:
    """Decode the body of a frame. Every buffer is copied out of ``buf``."""
    n_ids, n_oob, pickle_len = _META.unpack_from(buf, HEADER.size)
    offset = HEADER.size + _META.size
    lengths = [_LENGTH.unpack_from(buf, offset + _LENGTH.size * i)[0] for i in range(n_ids + n_oob)]
    offset += _LENGTH.size * len(lengths)
    data = buf[offset : offset + pickle_len]
    offset += pickle_len
    views: list[memoryview] = []
    for length in lengths:
        views.append(buf[offset : offset + length])
        offset += length
    # Pickle's own out-of-band buffers (numpy arrays) are rebuilt around a private copy.
    oob = [bytearray(v) for v in views[n_ids:]]
    return _Unpickler(data, views[:n_ids], oob).load()
