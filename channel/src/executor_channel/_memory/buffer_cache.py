"""Warm memory for what a reader keeps: :class:`BufferCache`, a bounded cache of reusable
anonymous mappings.

Why: a reader copies a large received message (one that spans several ring slots, or a large
out-of-band buffer of a one-slot message) into memory of its own, which the tensor or array
rebuilt from it then keeps. Freshly allocated, that memory is new pages from the kernel, and
the first touch of each page (a fault, the kernel zeroing it) costs several times the copy
itself; glibc serves every allocation above its largest mmap threshold that way, and gives it
back on free. This cache keeps the mappings it handed out once they are free again, so a
steady stream of large messages is copied into pages that are already faulted in.

A ``bytes`` object keeps its data inline, so it cannot live in a block: for one of 32 MiB or
more, :meth:`BufferCache.take_bytes` and :meth:`BufferCache.new_bytes` keep the process's heap
warm instead (``_heap``), under the same bounds and the same idle trim. The cache holds each
such object too (at most :data:`MAX_BLOCKS`), so that it knows, as for a block, when nothing
else refers to it any more: it then lets it go (into the warm heap) at its next trim or take.

Ownership: :meth:`BufferCache.take` returns a memoryview of a block. Everything built on it
(slices, ``PickleBuffer``\\ s, tensors, arrays) keeps the block's mapping alive through the
buffer protocol, so the mapping's reference count says whether anything still uses it. A block
is reused only once that count is back to what the cache alone holds: a received object
never shares memory with a later message, however long it is kept.

Bounds: free blocks are kept up to :data:`MAX_IDLE_BYTES` in all (counting what was handed
out of each: a block's capacity is rounded up, but pages never written cost no memory; least
recently used go first). Once no large message has come for :data:`IDLE_S`, the next trim
gives back everything free: it unmaps every free block and returns the free pages of the heap
to the kernel (``malloc_trim``); while messages keep coming, a trim unmaps a block seen free
for ``IDLE_S``. Blocks still in use are tracked only up to :data:`MAX_BLOCKS`; beyond that the
oldest are forgotten, and their memory goes back to the kernel when their objects are freed,
as without a cache. When the trims run is for the cache's users to say (see :mod:`.buffers`,
which holds the process's cache).

The rows that keep it (and the warm heap of :mod:`.heap`): ``executor bench``'s payloads on
``mp`` at default options. Without them (a fresh mapping per large message, ``bytes(view)``
for large ``bytes``) ``bytes 16 MiB`` took 14 times as long (41.7 ms against 3.0 ms),
``bytes 4 MiB`` 13 times, and ``tensor 64 MiB`` 12 times, behind vLLM's MessageQueue (1.1-1.35x
of it; one sitting of two runs each, 2026-12-06).
"""

from __future__ import annotations

import mmap
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from . import heap as _heap

__all__ = [
    "IDLE_S",
    "MAX_BLOCKS",
    "MAX_IDLE_BYTES",
    "MIN_BYTES",
    "BufferCache",
]

#: Smaller requests are plain ``bytearray``\ s: the allocator keeps memory of that size warm
#: itself, and a mapping per small message would cost more than it saves.
MIN_BYTES = 1 << 20
#: Free memory kept for reuse, in all. Four times the default broadcast ring, so messages of a
#: few ring sizes, alternating, all stay warm.
MAX_IDLE_BYTES = 256 << 20
#: No large message for this long and the process gives back every free block and heap page
#: (a block free this long is unmapped even while messages come): long enough to bridge the
#: gap between the steps of a running job, short enough that an idle process soon gives the
#: memory back.
IDLE_S = 2.0
#: Blocks tracked at most (free or in use), and as many large ``bytes``: bounds the scans.
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


class _Held:
    """A large ``bytes`` made from the warm heap, held until nothing else refers to it."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def _held_refs(held: _Held) -> int:
    # One function for every count, as for blocks (``_refs``).
    return sys.getrefcount(held.data)


#: What :func:`_held_refs` says of an object that only its holder refers to.
_HELD_ALONE = _held_refs(_Held(bytes(64)))


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
        # When a block or warm heap memory was last handed out: the process is idle, and
        # everything free goes back, once this is ``idle_s`` old.
        self._used_at = 0.0
        # The large ``bytes`` made from the warm heap that may still be referenced (oldest
        # first); and whether the heap holds memory freed since its last trim, or may.
        self._held: list[_Held] = []
        self._heap_dirty = False
        # Called, lock held, when the cache starts keeping memory while it kept none: a
        # thread watching it (:class:`IdleTrim`) then stops sleeping without a timeout.
        self._wakers: list[Callable[[], None]] = []

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
            self._wake_watchers()
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
            self._used_at = now  # a message came: this trim is a busy one
            self._trim(now, self.idle_s)
        return view

    def take_bytes(self, view: Any) -> bytes:
        """``bytes(view)``, warm: one of :data:`_heap.MMAP_CEILING` or more comes from the
        process's heap, which keeps it after it is freed, up to :attr:`max_idle_bytes` and until
        the process has gone :attr:`idle_s` without a large message (see :mod:`.heap`)."""
        if memoryview(view).nbytes < _heap.MMAP_CEILING:
            return bytes(view)
        with self._lock:
            self._let_go()  # first, so that their memory is the heap's to reuse
        data = _heap.allocate_bytes(view, self.max_idle_bytes)
        self._hold(data)
        return data

    def new_bytes(self, nbytes: int) -> tuple[bytes, memoryview] | None:
        """A new ``bytes`` of ``nbytes`` to fill through the returned view, warm as
        :meth:`take_bytes` makes it (see :func:`.heap.new_bytes`); None if not possible here."""
        if nbytes >= _heap.MMAP_CEILING:
            with self._lock:
                self._let_go()
        made = _heap.new_bytes(nbytes, self.max_idle_bytes)
        if made is not None:
            self._hold(made[0])
        return made

    def _hold(self, data: bytes) -> None:
        """Track ``data`` if it came from the warm heap."""
        if not (_heap.MMAP_CEILING <= len(data) <= self.max_idle_bytes and _heap.enabled()):
            return
        with self._lock:
            self._wake_watchers()
            self._held.append(_Held(data))
            if len(self._held) > self.max_blocks:
                # Forget the oldest: its memory goes to the heap when it is freed, and back to
                # the kernel at the heap's next trim.
                del self._held[0]
            self._heap_dirty = True
            self._used_at = time.monotonic()

    def trim(self) -> int:
        """Give back what is free: every free block and the heap's free pages if no large
        message came for :attr:`idle_s`, else the blocks seen free at least :attr:`idle_s`
        ago; returns the bytes unmapped (counted as :meth:`stats` counts them).

        A block is seen free by a trim, so one is unmapped at most ``idle_s`` after the last
        large message or after it was freed, whichever is later, plus the time to the next
        trim, if trims come at least every ``idle_s``.
        """
        with self._lock:
            return self._trim(time.monotonic(), self.idle_s)

    def tick(self) -> None:
        """:meth:`trim` if anything is kept and the last trim is :attr:`idle_s` old: cheap
        enough for every message a ring reads, so a busy reader that no longer receives large
        messages still gives their blocks back."""
        if self._keeps() and time.monotonic() >= self._trim_at:
            self.trim()

    def release(self) -> int:
        """Give back everything free now; returns the bytes unmapped."""
        with self._lock:
            return self._trim(time.monotonic(), 0.0)

    def trim_wait_s(self) -> float | None:
        """How long a reader with nothing else to do may sleep before it calls :meth:`trim`:
        None while nothing is free to give back (no timeout is needed for the cache's sake; a
        block or ``bytes`` freed meanwhile is seen by the next :meth:`tick` or :meth:`take`).
        For a reader whose own thread frees what it received before it waits (a worker)."""
        if self._heap_dirty:
            return self.idle_s
        if not (self._blocks or self._held):
            return None
        with self._lock:
            free = any(_free(block) for block in self._blocks) or any(
                _held_refs(held) == _HELD_ALONE for held in self._held
            )
        return self.idle_s if free else None

    def watch_wait_s(self) -> float | None:
        """How long a thread that watches the cache for others (:class:`IdleTrim`) may sleep
        before it calls :meth:`trim_if_due`: until :attr:`idle_s` after the last large message, then
        every ``idle_s`` while the cache keeps or tracks anything (a received object still
        referenced may be freed at any moment); None once it keeps nothing."""
        with self._lock:  # not between a waker's call and the change it announces
            if not self._keeps():
                return None
            due = max(self._used_at + self.idle_s, self._trim_at)
        return max(0.0, due - time.monotonic())

    def trim_if_due(self) -> None:
        """:meth:`trim` if :meth:`watch_wait_s` says one is due now (the watch's trim)."""
        wait = self.watch_wait_s()
        if wait is not None and wait <= 0.0:
            self.trim()

    def add_waker(self, wake: Callable[[], None]) -> None:
        """Call ``wake()`` (from the receiving thread, with the cache's lock held: it must not
        block) whenever the cache starts keeping memory while it kept none."""
        with self._lock:
            self._wakers.append(wake)

    def remove_waker(self, wake: Callable[[], None]) -> None:
        """Stop calling ``wake``; once this returns, it is not running either."""
        with self._lock:
            if wake in self._wakers:
                self._wakers.remove(wake)

    def stats(self) -> tuple[int, int]:
        """``(free bytes kept, bytes in use)`` among the tracked blocks (as they count for
        the bounds: the most each block was ever asked for)."""
        with self._lock:
            free = sum(b.size for b in self._blocks if _free(b))
            used = sum(b.size for b in self._blocks if not _free(b))
        return free, used

    def _keeps(self) -> bool:
        """Whether a trim may have anything to give back, now or once an object is freed."""
        return bool(self._blocks or self._held or self._heap_dirty)

    def _wake_watchers(self) -> None:
        """Before the cache takes memory: wake the watchers if it kept none. Lock held."""
        if self._wakers and not self._keeps():
            for wake in self._wakers:
                wake()

    def _let_go(self) -> None:
        """Drop the held ``bytes`` nothing else refers to: their memory becomes the heap's
        free memory. Lock held."""
        held = self._held
        if held:
            kept = [h for h in held if _held_refs(h) != _HELD_ALONE]
            if len(kept) < len(held):
                self._held = kept
                self._heap_dirty = True

    def _trim(self, now: float, idle_s: float) -> int:
        """Unmap free blocks: all of them once no large message came for ``idle_s``, else
        those seen free for ``idle_s`` or beyond the byte bound (least recently used first);
        forget the oldest blocks beyond :attr:`max_blocks`; let go of the ``bytes`` held for
        nothing, and trim the heap once idle. Lock held."""
        idle = now - self._used_at >= idle_s
        released = 0
        keep_bytes = self.max_idle_bytes
        kept: list[_Block] = []
        for block in reversed(self._blocks):  # most recently used first
            if _free(block):
                if block.free_since is None:
                    block.free_since = now
                if idle or now - block.free_since >= idle_s or block.size > keep_bytes:
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
        self._let_go()
        if self._heap_dirty and idle:
            self._heap_dirty = False
            _heap.trim()
        self._trim_at = now + self.idle_s
        return released

    def _after_fork(self) -> None:
        # The child is single-threaded: a lock another thread held at the fork would never
        # be released. The blocks are copy-on-write copies, still the child's to reuse; the
        # parent's watchers are not the child's.
        self._lock = threading.Lock()
        self._wakers = []
