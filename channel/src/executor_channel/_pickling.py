"""How a call's or reply's body is pickled, and rebuilt: pickle protocol 5, with bulk memory
out of band.

CPU tensors, numpy arrays and large ``bytes`` (the body itself, and items of small tuples,
lists and dicts in it) are not copied into the pickle stream: their memory travels as separate
out-of-band buffers, each with flags (:data:`FOREIGN`, :data:`BYTES`) that :mod:`._codec`
writes into the frame. The receiver either copies each once into memory it owns (large
buffers into warm memory of the receive buffer cache, ``_buffers``, which reuses a block only
once nothing refers to it), or, given a :class:`pickle.PickleBuffer`, uses them in place:
memory the receiver owns, or a worker's private view of its call's slot (``_slot_views``),
which the ring does not reuse while anything built on it lives. Everything else is ordinary
pickle.
"""

from __future__ import annotations

import copyreg
import pickle
import sys
import threading
from typing import Any

from . import _buffers

__all__ = ["BYTES", "FOREIGN", "OOB_BYTES_THRESHOLD", "SCALARS", "dumps", "scan"]

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
