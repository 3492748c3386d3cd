"""Warm memory for what a reader keeps: a bounded cache of reusable anonymous mappings.

Why: a reader copies a large received message (one that spans several ring slots, or a large
out-of-band buffer of a one-slot message) into memory of its own, which the tensor or array
rebuilt from it then keeps. Freshly allocated, that memory is new pages from the kernel, and
the first touch of each page (a fault, the kernel zeroing it) costs several times the copy
itself; glibc serves every allocation above its largest mmap threshold that way, and gives it
back on free. This cache keeps the mappings it handed out once they are free again, so a
steady stream of large messages is copied into pages that are already faulted in.

A ``bytes`` object keeps its data inline, so it cannot live in a block: for one of 32 MiB or
more, :meth:`BufferCache.take_bytes` and :meth:`BufferCache.new_bytes` keep the process's heap
warm instead (``_heap``), under the same bounds and the same idle trim.

Ownership: :meth:`BufferCache.take` returns a memoryview of a block. Everything built on it
(slices, ``PickleBuffer``\\ s, tensors, arrays) keeps the block's mapping alive through the
buffer protocol, so the mapping's reference count says whether anything still uses it. A block
is reused only once that count is back to what the cache alone holds: a received object
never shares memory with a later message, however long it is kept.

Bounds: free blocks are kept up to :data:`MAX_IDLE_BYTES` in all (counting what was handed
out of each: a block's capacity is rounded up, but pages never written cost no memory; least
recently used go first), and a block free for :data:`IDLE_S` is unmapped by the next trim: every
:meth:`~BufferCache.take`, a ring read once every ``IDLE_S`` (:meth:`~BufferCache.tick`), and a
reader blocked on its ring while a free block is cached (see ``Ring.wait_readable``).
:func:`release` unmaps every free block at once (for a process about to sleep, or a driver
whose executor is closed). Blocks still in use are tracked only up to :data:`MAX_BLOCKS`;
beyond that the oldest are forgotten, and their memory goes back to the kernel when their
objects are freed, as without a cache.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import time
from typing import Any

from . import _heap

__all__ = [
    "IDLE_S",
    "MAX_BLOCKS",
    "MAX_IDLE_BYTES",
    "MIN_BYTES",
    "BufferCache",
    "cache",
    "release",
    "take",
]

#: Smaller requests are plain ``bytearray``\ s: the allocator keeps memory of that size warm
#: itself, and a mapping per small message would cost more than it saves.
MIN_BYTES = 1 << 20
#: Free memory kept for reuse, in all. Four times the default broadcast ring, so messages of a
#: few ring sizes, alternating, all stay warm.
MAX_IDLE_BYTES = 256 << 20
#: A free block unused this long is unmapped: long enough to bridge the gap between the steps
#: of a running job, short enough that an idle process soon gives the memory back.
IDLE_S = 2.0
#: Blocks tracked at most (free or in use): bounds the scan in :meth:`BufferCache.take`.
MAX_BLOCKS = 64
#: Block sizes are rounded up to a quarter step of a power of two, in whole pages of this
#: size, so that messages of nearly the same size share blocks and at most a fifth is unused.
_GRANULE = 1 << 16


def _capacity(nbytes: int) -> int:
    """The block size for ``nbytes``: the next of 1, 1.25, 1.5, 1.75 times a power of two."""
    step = max(1 << (nbytes.bit_length() - 3), _GRANULE)
    return -(-nbytes // step) * step


class _Block:
    __slots__ = ("base", "capacity", "free_since", "map", "size", "used_at")

    def __init__(self, capacity: int, now: float) -> None:
        self.capacity = capacity
        # Private: a forked child gets a copy-on-write copy, never memory shared with us.
        self.map = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # The most ever handed out: pages beyond it were never touched, so cost no memory.
        # The bounds count this, not the capacity.
        self.size = 0
        self.used_at = now  # last handed out
        self.free_since: float | None = None  # first seen free since then, by a trim
        self.base = 0  # references to ``map`` when only the cache holds it (set by the cache)


def _refs(block: _Block) -> int:
    # Always measured through this one function, so that the count the cache alone accounts
    # for (``block.base``) and a later count are taken the same way.
    return sys.getrefcount(block.map)


def _free(block: _Block) -> bool:
    return _refs(block) == block.base


class BufferCache:
    """Blocks of warm memory handed out for received messages (see the module docstring).

    Thread-safe: readers of several rings in several threads share one cache.
    """

    def __init__(
        self,
        *,
        min_bytes: int = MIN_BYTES,
        max_idle_bytes: int = MAX_IDLE_BYTES,
        idle_s: float = IDLE_S,
        max_blocks: int = MAX_BLOCKS,
    ) -> None:
        self.min_bytes = min_bytes
        self.max_idle_bytes = max_idle_bytes
        self.idle_s = idle_s
        self.max_blocks = max_blocks
        self._lock = threading.Lock()
        self._blocks: list[_Block] = []  # oldest use first
        self._trim_at = 0.0  # when :meth:`tick` next trims
        # When a large ``bytes`` last took heap memory kept warm (see :meth:`take_bytes`);
        # 0.0 once the heap has been trimmed since.
        self._heap_used_at = 0.0

    def take(self, nbytes: int) -> memoryview:
        """``nbytes`` of writable memory the caller owns; its contents are undefined.

        The memory is reused for a later ``take`` only once nothing refers to the view or to
        anything built on it.
        """
        if nbytes < self.min_bytes:
            return memoryview(bytearray(nbytes))
        limit = _capacity(nbytes)
        with self._lock:
            now = time.monotonic()
            best: _Block | None = None
            for block in self._blocks:
                if (
                    nbytes <= block.capacity <= limit
                    and (best is None or block.capacity < best.capacity)
                    and _free(block)
                ):
                    best = block
            if best is None:
                best = _Block(limit, now)
                best.base = _refs(best)
            else:
                self._blocks.remove(best)
            best.used_at = now
            best.free_since = None
            best.size = max(best.size, nbytes)
            self._blocks.append(best)
            view = memoryview(best.map)[:nbytes]  # in use from here on
            self._trim(now, self.idle_s)
        return view

    def take_bytes(self, view: Any) -> bytes:
        """``bytes(view)``, warm: one of :data:`_heap.MMAP_CEILING` or more comes from the
        process's heap, which keeps it after it is freed, up to :attr:`max_idle_bytes` and until
        the heap has gone unused for :attr:`idle_s` (see :mod:`._heap`)."""
        data = _heap.allocate_bytes(view, self.max_idle_bytes)
        if len(data) >= _heap.MMAP_CEILING and _heap.enabled():
            self._heap_used_at = time.monotonic()
        return data

    def new_bytes(self, nbytes: int) -> tuple[bytes, memoryview] | None:
        """A new ``bytes`` of ``nbytes`` to fill through the returned view, warm as
        :meth:`take_bytes` makes it (see :func:`._heap.new_bytes`); None if not possible here."""
        made = _heap.new_bytes(nbytes, self.max_idle_bytes)
        if made is not None and nbytes >= _heap.MMAP_CEILING and _heap.enabled():
            self._heap_used_at = time.monotonic()
        return made

    def trim(self) -> int:
        """Unmap blocks seen free at least :attr:`idle_s` ago; returns the bytes unmapped
        (counted as :meth:`stats` counts them).

        A block is seen free by a trim, so one is unmapped between one and two ``idle_s``
        after it was freed, if trims come at least every ``idle_s``.
        """
        with self._lock:
            return self._trim(time.monotonic(), self.idle_s)

    def tick(self) -> None:
        """:meth:`trim` if blocks are tracked and the last trim is :attr:`idle_s` old: cheap
        enough for every message a ring reads, so a busy reader that no longer receives large
        messages still gives their blocks back."""
        if (self._blocks or self._heap_used_at) and time.monotonic() >= self._trim_at:
            self.trim()

    def release(self) -> int:
        """Unmap every free block now; returns the bytes unmapped."""
        with self._lock:
            return self._trim(time.monotonic(), 0.0)

    def trim_wait_s(self) -> float | None:
        """How long a reader with nothing else to do may sleep before it calls :meth:`trim`:
        None while no block is free (no timeout is needed for the cache's sake; a block freed
        meanwhile is seen by the next :meth:`tick` or :meth:`take`)."""
        if self._heap_used_at:
            return self.idle_s
        if not self._blocks:
            return None
        with self._lock:
            free = any(_free(block) for block in self._blocks)
        return self.idle_s if free else None

    def stats(self) -> tuple[int, int]:
        """``(free bytes kept, bytes in use)`` among the tracked blocks (as they count for
        the bounds: the most each block was ever asked for)."""
        with self._lock:
            free = sum(b.size for b in self._blocks if _free(b))
            used = sum(b.size for b in self._blocks if not _free(b))
        return free, used

    def _trim(self, now: float, idle_s: float) -> int:
        """Unmap free blocks seen free for ``idle_s`` or beyond the byte bound (least recently
        used first), and forget the oldest blocks beyond :attr:`max_blocks`. Lock held."""
        released = 0
        keep_bytes = self.max_idle_bytes
        kept: list[_Block] = []
        for block in reversed(self._blocks):  # most recently used first
            if _free(block):
                if block.free_since is None:
                    block.free_since = now
                if now - block.free_since >= idle_s or block.size > keep_bytes:
                    try:
                        block.map.close()  # no view of it is left: nothing can see it go
                    except BufferError:  # exported after all: keep it, in use
                        block.free_since = None
                        kept.append(block)
                        continue
                    released += block.size
                    continue
                keep_bytes -= block.size
            else:
                block.free_since = None
            kept.append(block)
        kept.reverse()
        if len(kept) > self.max_blocks:
            # Forget the oldest: a free one is unmapped as its last reference goes here, one
            # in use when the objects built on it are freed, as without a cache.
            del kept[: len(kept) - self.max_blocks]
        self._blocks = kept
        if self._heap_used_at and now - self._heap_used_at >= idle_s:
            self._heap_used_at = 0.0
            _heap.trim()
        self._trim_at = now + self.idle_s
        return released

    def _after_fork(self) -> None:
        # The child is single-threaded: a lock another thread held at the fork would never
        # be released. The blocks are copy-on-write copies, still the child's to reuse.
        self._lock = threading.Lock()


#: The process's cache, shared by every ring reader and the codec.
cache = BufferCache()
os.register_at_fork(after_in_child=lambda: cache._after_fork())  # the cache at fork time


def take(nbytes: int) -> memoryview:
    """:meth:`BufferCache.take` on the process's cache."""
    return cache.take(nbytes)


def release() -> int:
    """Unmap every free block of the process's cache now; returns the bytes unmapped."""
    return cache.release()
