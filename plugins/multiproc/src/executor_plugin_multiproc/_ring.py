"""A single-writer, multi-reader ring of fixed-size slots in shared memory.

Layout of a ring inside the segment (all counters little-endian u64, each on its own
64-byte line)::

    +0                   written: chunks published by the writer (futex word: low 32 bits)
    +8                   writer_waiting: set while the writer sleeps for a free slot
    +64 * (1 + i)        consumed[i]: chunks reader i has finished with
    slots_offset + k*S   slot k: chunk header (message bytes, chunk bytes) then data

A message is split into chunks of at most ``slot_bytes``; chunk ``c`` goes to slot
``c % slots``. A message that fits in the free slots is copied and published at once; a
larger one streams (the writer waits for readers to free slots while it writes), so no
payload is too big and none is truncated. Readers copy out what they read before releasing
its slots.

Waiting: a reader or writer first spins for ``spin_s`` (yielding the CPU each round), then
sleeps on a futex. The writer wakes readers after every publish; a reader wakes the writer
only when the writer has said it is waiting. That flag is set and read without a memory
fence, so a wake-up can in rare cases be missed: the writer's sleep is therefore bounded
(``_WRITER_NAP_S``) and it re-checks. Readers never miss a wake-up: the kernel compares the
``written`` word atomically before sleeping.
"""

from __future__ import annotations

import os
import struct
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import attrs

from . import _futex
from ._codec import Frame

__all__ = ["Ring", "RingAbortedError", "RingLayout"]

T = TypeVar("T")

_U64 = struct.Struct("<Q")
_CHUNK = struct.Struct("<QQ")  # message bytes, bytes in this chunk
_LINE = 64
_SLOT_HEADER = 64
_WRITER_NAP_S = 0.002
#: Longest single futex sleep; waits re-check their abort condition at least this often.
MAX_SLEEP_S = 0.1

if sys.byteorder != "little":  # pragma: no cover - every supported Linux target is little-endian
    raise ImportError("executor_plugin_multiproc needs a little-endian machine (futex words)")


class RingAbortedError(Exception):
    """Raised inside ring waits when the ``abort`` check asks to stop waiting."""


@attrs.frozen
class RingLayout:
    """Where a ring lives in the segment and how it is shaped."""

    offset: int
    readers: int
    slots: int
    slot_bytes: int

    @property
    def slots_offset(self) -> int:
        return self.offset + _align(_LINE * (1 + self.readers), 4096)

    @property
    def slot_stride(self) -> int:
        return _align(_SLOT_HEADER + self.slot_bytes, 4096)

    @property
    def nbytes(self) -> int:
        return self.slots_offset - self.offset + self.slots * self.slot_stride


def _align(value: int, to: int) -> int:
    return (value + to - 1) // to * to


def _never() -> None:
    return None


class Ring:
    """One side of a ring: the writer (``reader=None``) or reader number ``reader``."""

    def __init__(
        self,
        buf: memoryview,
        base_address: int,
        layout: RingLayout,
        *,
        reader: int | None,
        spin_s: float,
    ) -> None:
        self._buf = buf
        self._layout = layout
        self._reader = reader
        self._spin_s = spin_s
        self._written_off = layout.offset
        self._waiting_off = layout.offset + 8
        self._written_addr = base_address + self._written_off
        self._consumed_offs = [layout.offset + _LINE * (1 + i) for i in range(layout.readers)]
        self._consumed_addrs = [base_address + off for off in self._consumed_offs]
        self._slot_data = layout.slot_bytes
        self._slot_offs = [
            layout.slots_offset + k * layout.slot_stride for k in range(layout.slots)
        ]
        # This side's own count: chunks written (writer) or consumed (reader).
        self._count: int
        if reader is None:
            self._count = _U64.unpack_from(buf, self._written_off)[0]
        else:
            self._count = _U64.unpack_from(buf, self._consumed_offs[reader])[0]

    def wake_all(self) -> None:
        """Wake every sleeper on this ring (used when the executor fails or closes)."""
        _futex.wake(self._written_addr)
        for addr in self._consumed_addrs:
            _futex.wake(addr)

    # --- writer ------------------------------------------------------------------------

    def _free_slots(self) -> tuple[int, int]:
        """(free slots, index of the slowest reader)."""
        buf = self._buf
        slowest = 0
        lowest = self._count
        for i, off in enumerate(self._consumed_offs):
            consumed = _U64.unpack_from(buf, off)[0]
            if consumed < lowest:
                lowest, slowest = consumed, i
        return self._layout.slots - (self._count - lowest), slowest

    def _wait_for_space(
        self, needed: int, deadline: float | None, abort: Callable[[], None]
    ) -> bool:
        """Wait until ``needed`` slots are free; False if ``deadline`` passed first."""
        free, slowest = self._free_slots()
        if free >= needed:
            return True
        spin_until = time.monotonic() + self._spin_s
        while True:
            abort()
            free, slowest = self._free_slots()
            if free >= needed:
                return True
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            if now < spin_until:
                os.sched_yield()
                continue
            off = self._consumed_offs[slowest]
            seen = _U64.unpack_from(self._buf, off)[0]
            _U64.pack_into(self._buf, self._waiting_off, 1)
            try:
                if self._free_slots()[0] < needed:
                    nap = _WRITER_NAP_S if deadline is None else min(_WRITER_NAP_S, deadline - now)
                    _futex.wait(self._consumed_addrs[slowest], seen, nap)
            finally:
                _U64.pack_into(self._buf, self._waiting_off, 0)

    def write(
        self, frame: Frame, deadline: float | None = None, abort: Callable[[], None] = _never
    ) -> bool:
        """Publish ``frame`` to every reader.

        Returns False, having published nothing, if the slots it needs did not free up
        before ``deadline``. Once the first chunk is out, a streamed message is finished
        regardless of the deadline (readers would otherwise wait for its end), bounded only
        by ``abort``.
        """
        layout = self._layout
        slot_data = self._slot_data
        nbytes = frame.nbytes
        nchunks = max(1, -(-nbytes // slot_data))
        if not self._wait_for_space(min(nchunks, layout.slots), deadline, abort):
            return False
        buf = self._buf
        parts = list(frame.parts)
        part_index, part_pos = 0, 0
        remaining = nbytes
        unpublished = 0
        for chunk in range(nchunks):
            if chunk >= layout.slots and unpublished == 0:
                self._wait_for_space(1, None, abort)
            slot = self._slot_offs[(self._count + unpublished) % layout.slots]
            size = min(slot_data, remaining)
            _CHUNK.pack_into(buf, slot, nbytes, size)
            pos = slot + _SLOT_HEADER
            end = pos + size
            while pos < end:
                part = parts[part_index]
                take = min(part.nbytes - part_pos, end - pos)
                buf[pos : pos + take] = part[part_pos : part_pos + take]
                pos += take
                part_pos += take
                if part_pos == part.nbytes:
                    part_index, part_pos = part_index + 1, 0
            remaining -= size
            unpublished += 1
            free_after = chunk + 1 < nchunks and self._free_slots()[0] <= unpublished
            if chunk + 1 == nchunks or free_after:
                self._publish(unpublished)
                unpublished = 0
        return True

    def _publish(self, chunks: int) -> None:
        self._count += chunks
        _U64.pack_into(self._buf, self._written_off, self._count)
        _futex.wake(self._written_addr)

    # --- reader ------------------------------------------------------------------------

    def poll(self) -> bool:
        """True if a message is waiting for this reader (no system call)."""
        written: int = _U64.unpack_from(self._buf, self._written_off)[0]
        return written > self._count

    def wait_readable(self, deadline: float | None, abort: Callable[[], None] = _never) -> bool:
        """Wait until :meth:`poll` would be true; False if ``deadline`` passed first."""
        return self._wait_for_chunk(deadline, abort)

    def _wait_for_chunk(self, deadline: float | None, abort: Callable[[], None]) -> bool:
        buf = self._buf
        off = self._written_off
        if _U64.unpack_from(buf, off)[0] > self._count:
            return True
        spin_until = time.monotonic() + self._spin_s
        while True:
            abort()
            if _U64.unpack_from(buf, off)[0] > self._count:
                return True
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            if now < spin_until:
                os.sched_yield()
                continue
            nap = MAX_SLEEP_S if deadline is None else min(MAX_SLEEP_S, deadline - now)
            _futex.wait(self._written_addr, self._count, nap)

    def read(
        self,
        decode: Callable[[memoryview], T],
        deadline: float | None = None,
        abort: Callable[[], None] = _never,
    ) -> T | None:
        """Wait for the next message and return ``decode(view)``; None if ``deadline`` passed.

        ``decode`` must copy what it keeps: the view is only valid during the call. Once the
        first chunk of a message has arrived, the rest is awaited regardless of ``deadline``.
        """
        if not self._wait_for_chunk(deadline, abort):
            return None
        buf = self._buf
        layout = self._layout
        slot = self._slot_offs[self._count % layout.slots]
        nbytes, size = _CHUNK.unpack_from(buf, slot)
        if size == nbytes:
            view = buf[slot + _SLOT_HEADER : slot + _SLOT_HEADER + size]
            try:
                return decode(view)
            finally:
                view.release()
                self._release(1)
        whole = bytearray(nbytes)
        pos = 0
        while True:
            whole[pos : pos + size] = buf[slot + _SLOT_HEADER : slot + _SLOT_HEADER + size]
            pos += size
            self._release(1)
            if pos >= nbytes:
                break
            self._wait_for_chunk(None, abort)
            slot = self._slot_offs[self._count % layout.slots]
            _, size = _CHUNK.unpack_from(buf, slot)
        with memoryview(whole) as view:
            return decode(view)

    def _release(self, chunks: int) -> None:
        assert self._reader is not None, "only readers release slots"
        self._count += chunks
        off = self._consumed_offs[self._reader]
        _U64.pack_into(self._buf, off, self._count)
        if _U64.unpack_from(self._buf, self._waiting_off)[0]:
            _futex.wake(self._consumed_addrs[self._reader])
