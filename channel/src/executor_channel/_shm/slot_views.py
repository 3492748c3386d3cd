"""A reader's copy-on-write views of a ring's slots (:class:`SlotViews`): a call's tensors
and arrays are rebuilt on the slot itself, not copied out of it, and still belong to this
reader alone.

Each slot is mapped a second time in the reader, privately (``MAP_PRIVATE``): a page the
reader only reads is the shared page the writer wrote, so a message costs the reader no copy;
a page the reader writes (an in-place operation on its argument) becomes its own copy, so no
other reader, and not the writer, ever sees it. The slot stays held (the writer does not
refill it) until the call has returned; then :meth:`SlotViews.settle` restores the two
promises of a copied read before the slot is freed:

- **nothing a worker keeps changes under it.** If anything built on the view is still alive
  (the mapping's reference count says so, as for the receive buffer cache's blocks), every
  page of the message is written once, which makes each a private copy frozen as it is, and
  the slot gets a fresh mapping for its next message; the old one lives as long as what was
  kept, and is unmapped with it.
- **a later message is read as written.** A page the reader wrote stays its own copy, which
  would hide the writer's next message: ``/proc/self/pagemap`` says which pages of the
  message are private now, and those are dropped (``MADV_DONTNEED``), so they are read from
  the shared pages again.

Where ``/proc/self/pagemap`` cannot be read, or does not tell shared pages from private ones,
:meth:`SlotViews.open` returns None and the reader copies, as before.

The row that keeps it: ``executor bench``'s ``tensor 16 MiB`` payload on ``mp`` at default
options, whose worker reads one byte of every page of its argument. Without the views (every
call copied out of its slot) that row took 2.2 times as long (4.5 ms against 2.0 ms) and
1.02-1.05 times vLLM's MessageQueue, behind it; ``tensor 4 MiB`` 2.2 times as long, 1.12x of
vLLM in one run (one sitting, 2 runs a side, 2026-12-06; docs/benchmarks.md, "Calls read in
place").
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import struct
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .ring import RingLayout

__all__ = ["SlotViews"]

_PAGE = mmap.PAGESIZE
#: A pagemap entry's bits: the page is present, and it is a page of a file (or shared).
_PRESENT = 1 << 63
_FILE = 1 << 61
#: The same two bits in an entry's top byte (entries are little-endian u64s), and a table
#: that maps a top byte to 1 where the page is present and private (the reader wrote it).
_TOP_PRESENT = _PRESENT >> 56
_TOP_FILE = _FILE >> 56
_PRIVATE = bytes(int(byte & (_TOP_PRESENT | _TOP_FILE) == _TOP_PRESENT) for byte in range(256))


#: This process's ``/proc/self/pagemap``, opened once (and again in a forked child, whose
#: ``self`` is another process): every ring's views share it, so attaching rings again
#: opens no descriptor.
_pagemap: tuple[int, int] | None = None  # (process id, descriptor)
_pagemap_lock = threading.Lock()


def _pagemap_fd() -> int:
    global _pagemap
    with _pagemap_lock:
        pid = os.getpid()
        if _pagemap is None or _pagemap[0] != pid:
            _pagemap = (pid, os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC))
        return _pagemap[1]


def _address(mapping: mmap.mmap) -> int:
    holder = ctypes.c_char.from_buffer(mapping)
    try:
        return ctypes.addressof(holder)
    finally:
        del holder  # an export of the mapping: it would block its close


class SlotViews:
    """Private mappings of ring ``layout``'s slots in segment ``fd``, one per slot, made when
    first used. Use :meth:`open`."""

    def __init__(self, fd: int, layout: RingLayout, pagemap: int) -> None:
        self._fd = fd
        self._offsets = [layout.slots_offset + k * layout.slot_stride for k in range(layout.slots)]
        self._stride = layout.slot_stride
        self._pagemap = pagemap
        self._maps: list[mmap.mmap | None] = [None] * layout.slots
        self._addresses = [0] * layout.slots
        self._base = [0] * layout.slots
        #: Messages whose views were still referenced after their call (frozen and
        #: remapped), and messages whose pages the reader wrote (dropped): for tests.
        self.kept = 0
        self.written = 0

    @classmethod
    def open(cls, fd: int, layout: RingLayout) -> SlotViews | None:
        """Views of ``layout``'s slots, or None where this process cannot tell a private page
        from a shared one (then the reader must copy)."""
        try:
            pagemap = _pagemap_fd()
        except OSError:
            return None
        views = cls(fd, layout, pagemap)
        try:
            if views._tells_pages_apart():
                return views
        except OSError:
            pass
        views.close()
        return None

    def _tells_pages_apart(self) -> bool:
        """Whether the pagemap shows a read page as the segment's and a written one as not:
        tried on a scratch private mapping of the first slot, never on a slot in use."""
        scratch = mmap.mmap(
            self._fd,
            _PAGE,
            flags=mmap.MAP_PRIVATE,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
            offset=self._offsets[0],
        )
        try:
            address = _address(scratch)
            scratch[0]  # a read maps the shared page
            read = self._entries(address, 1)[0]
            scratch[0] = scratch[0]  # a write makes it private
            written = self._entries(address, 1)[0]
        finally:
            scratch.close()
        return bool(read & _PRESENT and read & _FILE and written & _PRESENT) and not (
            written & _FILE
        )

    def _entries(self, address: int, pages: int) -> tuple[int, ...]:
        data = os.pread(self._pagemap, 8 * pages, address // _PAGE * 8)
        return struct.unpack(f"{len(data) // 8}Q", data)

    def _mapping(self, slot: int) -> mmap.mmap:
        mapping = self._maps[slot]
        if mapping is None:
            mapping = mmap.mmap(
                self._fd,
                self._stride,
                flags=mmap.MAP_PRIVATE,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
                offset=self._offsets[slot],
            )
            self._maps[slot] = mapping
            self._addresses[slot] = _address(mapping)
            self._base[slot] = sys.getrefcount(mapping)
        return mapping

    def view(self, slot: int, start: int, end: int) -> memoryview:
        """Bytes ``start`` to ``end`` of slot ``slot`` (offsets within the slot), privately."""
        return memoryview(self._mapping(slot))[start:end]

    def shared(self, slot: int) -> bool:
        """Whether anything built on a view of ``slot`` is still alive."""
        mapping = self._maps[slot]
        return mapping is not None and sys.getrefcount(mapping) > self._base[slot]

    def settle(self, slot: int, start: int, end: int) -> None:
        """Make slot ``slot`` ready to be freed once bytes ``start`` to ``end`` were read in
        place and their call returned (see the module): freeze and replace its mapping if
        anything still refers to it, else drop the pages the reader wrote."""
        kept = self.shared(slot)  # before this method holds the mapping too
        mapping = self._maps[slot]
        if mapping is None:
            return
        first = start - start % _PAGE
        if kept:
            for offset in range(first, end, _PAGE):
                mapping[offset] = mapping[offset]  # private from now on, as it is
            self._maps[slot] = None  # what was kept holds it; a new mapping next time
            self.kept += 1
            return
        pages = -(-(end - first) // _PAGE)
        data = os.pread(self._pagemap, 8 * pages, (self._addresses[slot] + first) // _PAGE * 8)
        private = data[7::8].translate(_PRIVATE)  # one byte a page: 1 if the reader wrote it
        low = private.find(1)
        if low >= 0:
            high = private.rfind(1) + 1
            mapping.madvise(mmap.MADV_DONTNEED, first + low * _PAGE, (high - low) * _PAGE)
            self.written += 1

    def close(self) -> None:
        """Drop the mappings (one still referenced goes with what refers to it). Idempotent.
        The pagemap's descriptor is the process's, kept for the next views."""
        maps, self._maps = self._maps, [None] * len(self._maps)
        for mapping in maps:
            if mapping is not None:
                with contextlib.suppress(BufferError):
                    mapping.close()
