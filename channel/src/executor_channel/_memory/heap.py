"""Warm heap memory for large ``bytes`` that a receiver rebuilds (glibc only).

Why: a received ``bytes`` object keeps its data inline, allocated by the interpreter, so the
receive buffer cache (``_buffers``) cannot lend it warm memory as it does to tensors and arrays.
glibc serves every allocation at or above its largest mmap threshold (:data:`MMAP_CEILING`) by a
fresh mapping and unmaps it again on free, so each such object costs the kernel's page faults
and zeroing, several times the copy itself (docs/benchmarks.md, the payload sweep).

What: :func:`allocate_bytes` makes such an object with mappings switched off for that one
allocation, so it comes from the heap; and the first time, it raises the process's trim
threshold to the cache's bound on idle memory, so that the freed object stays in the heap for
the next one instead of going back to the kernel. The cache gives that memory back as it gives
back its own blocks: after ``_buffers.IDLE_S`` without a large message, :func:`trim` returns
every free page of the heap to the kernel (``malloc_trim``).

Limits: an allocation by a thread other than the main one comes from that thread's arena, whose
heaps glibc caps at 64 MiB; above that glibc maps fresh memory whatever the setting. Without
glibc (musl, macOS) nothing changes.
"""

from __future__ import annotations

import ctypes
import platform
import sys
import threading
from typing import Any

__all__ = ["MMAP_CEILING", "allocate_bytes", "enabled", "new_bytes", "trim"]

#: glibc's largest dynamic mmap threshold on 64-bit systems (``DEFAULT_MMAP_THRESHOLD_MAX``):
#: smaller allocations come from the heap once the process has freed one of their size.
MMAP_CEILING = 32 << 20

# From glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_DEFAULT_MMAP_MAX = 65536

_lock = threading.Lock()
_libc: Any = None
_state = "unset"  # "unset", "on" (glibc, set up), "off" (not glibc, or mallopt refused)


def _setup(keep_bytes: int) -> bool:
    """Once per process: load glibc's malloc controls and raise the trim threshold. Lock held."""
    global _libc, _state
    if _state == "unset":
        _state = "off"
        if platform.libc_ver()[0] == "glibc":
            libc = ctypes.CDLL(None, use_errno=True)
            # Setting the trim threshold also freezes glibc's dynamic mmap threshold, so it is
            # set to the ceiling the dynamic one reaches anyway: below it, the heap serves.
            if libc.mallopt(_M_MMAP_THRESHOLD, MMAP_CEILING) and libc.mallopt(
                _M_TRIM_THRESHOLD, keep_bytes
            ):
                _libc, _state = libc, "on"
    return _state == "on"


def enabled() -> bool:
    """True once :func:`allocate_bytes` has set up this process's heap."""
    return _state == "on"


def allocate_bytes(view: Any, keep_bytes: int) -> bytes:
    """``bytes(view)``, from the heap when ``view`` is at least :data:`MMAP_CEILING` and at most
    ``keep_bytes`` long (a larger one would be trimmed on free anyway)."""
    nbytes = memoryview(view).nbytes
    if nbytes < MMAP_CEILING or nbytes > keep_bytes:
        return bytes(view)
    with _lock:
        if not _setup(keep_bytes):
            return bytes(view)
        # Other threads allocating meanwhile also get heap memory: harmless.
        _libc.mallopt(_M_MMAP_MAX, 0)
        try:
            return bytes(view)
        finally:
            _libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)


_from_size: Any = None
_data_of: Any = None
if sys.implementation.name == "cpython":
    _from_size = ctypes.pythonapi.PyBytes_FromStringAndSize
    _from_size.restype = ctypes.py_object
    _from_size.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
    _data_of = ctypes.pythonapi.PyBytes_AsString
    _data_of.restype = ctypes.c_void_p
    _data_of.argtypes = (ctypes.py_object,)


def new_bytes(nbytes: int, keep_bytes: int) -> tuple[bytes, memoryview] | None:
    """A new ``bytes`` object of ``nbytes`` (from the heap as :func:`allocate_bytes` says)
    and a writable view of its data, for the receiver to copy into before anything else sees
    the object (as CPython's own code fills a new ``bytes``); None off CPython.

    The view does not keep the object alive: hold both until it is filled.
    """
    if _from_size is None or nbytes <= 0:
        return None
    with _lock:
        heap = MMAP_CEILING <= nbytes <= keep_bytes and _setup(keep_bytes)
        if heap:
            _libc.mallopt(_M_MMAP_MAX, 0)
        try:
            data: bytes = _from_size(None, nbytes)
        finally:
            if heap:
                _libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
    view = memoryview((ctypes.c_char * nbytes).from_address(_data_of(data))).cast("B")
    return data, view


def trim() -> None:
    """Give every free page of the heap back to the kernel (no-op before :func:`allocate_bytes`
    set the heap up)."""
    if _state == "on":
        _libc.malloc_trim(0)
