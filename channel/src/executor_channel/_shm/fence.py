"""Ordered access to the ring's counters in shared memory (see docs/memory-ordering.md).

A ring's writer and readers are processes that share a mapping and nothing else: what one of
them stores becomes visible to the others in an order only the CPU decides, unless a fence
says otherwise. Every access to a counter or flag of the ring goes through this module:

``load(buf, offset)``
    the 8-byte load, ordered by nothing: returns ``(value,)``, as ``struct`` does. A load
    whose value lets the caller go on to the data it guards is followed by
    ``acquire_fence()`` (where ``WEAK_ORDER``): that pair is a load-acquire, and the loads
    that only find nothing new yet need no fence.
``acquire_fence()``
    no load or store after it happens before the loads before it.
``load_acquire(buf, offset)``
    ``load`` then ``acquire_fence`` (where needed), in one call.
``store_release(buf, offset, value)``
    a release fence, then the 8-byte store: every load and store before it (the slot's data,
    or the reads of a slot being released) is visible before the new value is.
``store_fence_load(buf, offset, value, other)``
    ``store_release``, a full fence, then ``load_acquire`` of ``other``: one side of a
    sleep/wake-up handshake, where a store must be ordered before a later load.
``fence_seq_cst()``
    a full fence.

The fences are C11's ``atomic_thread_fence`` from GCC's runtime library ``libatomic.so.1``,
called through :mod:`ctypes` without releasing the GIL (figures: docs/benchmarks.md, the
ring's memory fences). That function takes the order at run time, so GCC built it as the
full fence whatever the order: ``dmb ish`` on aarch64, a locked instruction on x86-64 (more
than acquire or release need; the call costs more than the instruction anyway). Where the
library cannot be loaded, every fence is the *lock fence*: a release of a process-private
lock followed by an acquire of it, two atomic read-modify-writes on its word, a
store-release followed in program order by a load-acquire, which aarch64 keeps in order
(they are "RCsc") and which x86-64 executes as locked instructions; both are full barriers
there.

On x86-64 (total store order: no load passes a load, no store passes a store or an earlier
load) acquire and release fences need no instruction, as C compilers emit none; only the
full fence does something. Elsewhere every fence is issued.

The counters are aligned native 8-byte integers, each loaded and stored by one instruction,
which is single-copy atomic on x86-64 and aarch64 (a reader sees the old value or the new
one, never a mix): loads by ``struct``'s native ``'@Q'`` (one ``memcpy`` of 8 bytes into a
C integer), stores through a one-item ``'Q'`` cast of the counter's 8 bytes (one ``memcpy``
from a C integer). Not ``struct.pack_into``: it zero-fills its destination before it writes
the value, so a reader could see 0 in between.

``EXECUTOR_CHANNEL_FENCE`` (for tests and benchmarks): ``auto`` (the default, as above),
``weak`` (issue acquire and release fences on x86-64 too, as a weakly ordered CPU needs), or
``lock`` (``weak`` with the lock fence instead of libatomic's).
"""

from __future__ import annotations

import functools
import os
import struct
import threading
from collections.abc import Callable
from typing import Any

__all__ = [
    "ENV",
    "FENCE",
    "WEAK_ORDER",
    "acquire_fence",
    "fence_seq_cst",
    "load",
    "load_acquire",
    "store_fence_load",
    "store_release",
]

#: The environment variable that overrides the choice (see module docstring).
ENV = "EXECUTOR_CHANNEL_FENCE"
_MODES = ("auto", "weak", "lock")
#: CPUs with total store order: acquire and release fences are no-ops there.
_TSO_MACHINES = frozenset({"x86_64", "amd64"})
# GCC's __ATOMIC_* memory orders, the argument of atomic_thread_fence.
_ACQUIRE, _RELEASE, _SEQ_CST = 2, 3, 5

_U64 = struct.Struct("@Q")


def _libatomic_fence() -> Callable[[int], Any] | None:
    """GCC's ``atomic_thread_fence(order)`` from libatomic, or None where it is missing."""
    try:
        import ctypes

        # PyDLL: called with the GIL held (no release and re-acquire around 3 instructions).
        fence = ctypes.PyDLL("libatomic.so.1").atomic_thread_fence
    except (ImportError, OSError, AttributeError):
        return None
    fence.restype = None
    return fence


def _lock_fence() -> Callable[[], None]:
    """A full fence from a lock: release, then acquire (see module docstring).

    The lock is taken and given back twice, so that threads of one process may fence at
    once: whoever holds it, each call's first release and second acquire are a release
    followed by an acquire of the same lock word."""
    lock = threading.Lock()
    acquire, release = lock.acquire, lock.release

    def fence() -> None:
        acquire()
        release()
        acquire()
        release()

    return fence


_Fence = Callable[[], None]


def _choose(mode: str, machine: str) -> tuple[str, bool, _Fence, _Fence, _Fence]:
    """``(name, weak order, acquire, release, full)`` for ``mode`` on ``machine``."""
    if mode not in _MODES:
        raise ValueError(f"{ENV}={mode!r}: expected one of {', '.join(_MODES)}")
    weak = mode != "auto" or machine.lower() not in _TSO_MACHINES
    raw = None if mode == "lock" else _libatomic_fence()
    if raw is None:
        full = _lock_fence()
        return "lock", weak, full, full, full
    return (
        "libatomic",
        weak,
        functools.partial(raw, _ACQUIRE),
        functools.partial(raw, _RELEASE),
        functools.partial(raw, _SEQ_CST),
    )


#: Which fence is used: ``"libatomic"`` or ``"lock"``.
FENCE: str
#: True where acquire and release fences are issued (every CPU but x86-64, or forced).
WEAK_ORDER: bool
#: The acquire fence: call it only ``if WEAK_ORDER`` (elsewhere it is not needed).
acquire_fence: Callable[[], None]
_release_fence: Callable[[], None]
#: A full (sequentially consistent) fence.
fence_seq_cst: Callable[[], None]
FENCE, WEAK_ORDER, acquire_fence, _release_fence, fence_seq_cst = _choose(
    os.environ.get(ENV, "auto") or "auto", os.uname().machine
)

#: The 8-byte load, unordered; returns ``(value,)``.
load: Callable[[memoryview, int], tuple[Any, ...]] = _U64.unpack_from


def _load_fenced(
    buf: memoryview, offset: int, _fence: Callable[[], None] = acquire_fence
) -> tuple[Any, ...]:
    value = _U64.unpack_from(buf, offset)
    _fence()
    return value


def _store_plain(buf: memoryview, offset: int, value: int) -> None:
    # One 8-byte store (CPython's memoryview packs a 'Q' item with one memcpy of 8 bytes);
    # the views live only for this statement, so the mapping can be closed afterwards.
    buf[offset : offset + 8].cast("Q")[0] = value


def _store_fenced(
    buf: memoryview, offset: int, value: int, _fence: Callable[[], None] = _release_fence
) -> None:
    _fence()
    buf[offset : offset + 8].cast("Q")[0] = value


def _store_fence_load_plain(
    buf: memoryview, offset: int, value: int, other: int, _full: Callable[[], None] = fence_seq_cst
) -> int:
    buf[offset : offset + 8].cast("Q")[0] = value
    _full()
    loaded: int = _U64.unpack_from(buf, other)[0]
    return loaded


def _store_fence_load_fenced(
    buf: memoryview,
    offset: int,
    value: int,
    other: int,
    _release: Callable[[], None] = _release_fence,
    _full: Callable[[], None] = fence_seq_cst,
    _acquire: Callable[[], None] = acquire_fence,
) -> int:
    _release()
    buf[offset : offset + 8].cast("Q")[0] = value
    _full()
    loaded: int = _U64.unpack_from(buf, other)[0]
    _acquire()
    return loaded


#: ``load`` then an acquire fence (where needed); returns ``(value,)``.
load_acquire: Callable[[memoryview, int], tuple[Any, ...]]
#: A release fence (where needed), then the 8-byte store.
store_release: Callable[[memoryview, int, int], None]
#: ``store_release(buf, offset, value)``, a full fence, ``load_acquire(buf, other)[0]``.
store_fence_load: Callable[[memoryview, int, int, int], int]
if WEAK_ORDER:
    load_acquire, store_release = _load_fenced, _store_fenced
    store_fence_load = _store_fence_load_fenced
else:  # total store order: a plain load or store is an acquire or release one
    load_acquire, store_release = _U64.unpack_from, _store_plain
    store_fence_load = _store_fence_load_plain
