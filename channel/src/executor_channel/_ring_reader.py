"""A ring's reader (:class:`RingReader`): it waits for the next message, hands it to its
``decode`` and frees its slots; a message of several slots it copies out as it streams in,
into memory it owns (:data:`Received`, :data:`Assemble`). With private views of the slots
(:mod:`._slot_views`), :meth:`RingReader.read_held` hands a message of one slot over in place
and holds the slot until :meth:`RingReader.release_held`.

Its steps are the reader's rows of the counter protocol in :mod:`._ring`.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from typing import TypeVar

from . import _buffers, _ring_layout
from ._fence import WEAK_ORDER, acquire_fence, load, store_fence_load
from ._ring_end import MAX_SLEEP_S, RingEnd
from ._ring_layout import SLOT_HEADER, WITHDRAWN

__all__ = ["Assemble", "Assembled", "Received", "RingReader"]

#: The slot header's struct, bound here rather than imported by name: CPython compiles a
#: method call on an imported name as an attribute load, a bound method made on each call.
_CHUNK = _ring_layout.CHUNK

T = TypeVar("T")

#: :meth:`RingReader.read_held` reads a message in place from this size: below it, copying
#: what the message carries costs less than holding its slot and checking its pages after
#: the call (figures: docs/benchmarks.md, "Calls read in place").
IN_PLACE_MIN = 64 << 10


class Assembled:
    """A message of several slots that the reader copied into several pieces of memory it
    owns, as the ``assemble`` function given to :meth:`Ring.read` placed them; ``parts`` is
    what that function made of them (see :func:`._codec.plan_assembly`)."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[object]) -> None:
        self.parts = parts


#: What a reader's ``decode`` gets: a view of the slot for a message of one slot (valid only
#: during the call: copy what you keep), a PickleBuffer over memory the reader owns for a
#: message that spanned several slots (it was copied out once; keep it as it is), or an
#: :class:`Assembled` message when the reader's ``assemble`` placed it.
Received = memoryview | pickle.PickleBuffer | Assembled
#: ``assemble(first_chunk, message_bytes)``: where to copy a message of several slots, as
#: writable views that follow one another through the message and together cover it, and what
#: ``decode`` gets once they are filled; None to copy it into one block of the buffer cache.
Assemble = Callable[[memoryview, int], "tuple[list[memoryview], Assembled] | None"]


class RingReader(RingEnd):
    """The readers' methods of a :class:`~._ring.Ring`."""

    def poll(self) -> bool:
        """True if a message is waiting for this reader (no system call). Only a hint:
        :meth:`read` and :meth:`try_read` look again (with acquire order) before they
        touch the slot."""
        written: int = load(self._buf, self._written_off)[0]
        return written > self._count

    def wait_readable(
        self, deadline: float | None, abort: Callable[[], None] | None = None
    ) -> bool:
        """Wait until :meth:`poll` would be true; False if ``deadline`` passed first.

        Without ``deadline`` and ``abort``, a blocking doorbell is slept on without a cap,
        except while the receive buffer cache holds something free to give back: then the
        sleep is cut after ``_buffers.IDLE_S`` to give back what stayed unused.
        """
        buf = self._buf
        off = self._written_off
        count = self._count
        if load(buf, off)[0] > count:
            if WEAK_ORDER:
                acquire_fence()  # that load, before the caller reads the slot
            return True
        bell = self._data_bells[0]
        spin = self._spin
        spin_until = spin.start(self._wait_spin_s) if spin is not None else 0.0
        while True:
            if abort is not None:
                abort()
            if load(buf, off)[0] > count:
                if WEAK_ORDER:
                    acquire_fence()
                return True
            if spin_until:
                if time.monotonic() < spin_until and spin is not None:
                    if spin.pause():
                        continue
                    spin_until = 0.0
                    if load(buf, off)[0] > count:  # it came while this process was off
                        if self._next_is_small():  # the CPU: the spin delayed it
                            spin.contended()
                        continue  # (the look above, again with its fence)
                spin_until = 0.0
            if deadline is None:
                if abort is not None:
                    bell.wait(MAX_SLEEP_S)
                    continue
                # Nothing to do until the next message: give back cached receive memory
                # left unused meanwhile (a bounded sleep only while something is free).
                cache = _buffers.cache
                trim_wait = cache.trim_wait_s()
                bell.wait(trim_wait)
                if trim_wait is not None and load(buf, off)[0] <= count:
                    cache.trim()
                continue
            now = time.monotonic()
            if now >= deadline:
                return False
            bell.wait(min(MAX_SLEEP_S, deadline - now))

    def small_waiting(self) -> bool:
        """True if the next message waiting for this reader fits in one slot (a short
        answer, not part of a large transfer); False if none is waiting."""
        return self.poll() and self._next_is_small()

    def _next_is_small(self) -> bool:
        """Whether the waiting message (there is one) fits in one slot."""
        if WEAK_ORDER:
            acquire_fence()  # the caller's load of ``written``, before the slot's header
        slot = self._slot_offs[self._count % self._nslots]
        nbytes, size = _CHUNK.unpack_from(self._buf, slot)
        return bool(nbytes == size)

    def try_read(
        self,
        decode: Callable[[Received], T],
        abort: Callable[[], None] | None = None,
        assemble: Assemble | None = None,
    ) -> T | None:
        """``decode`` the next message if one is waiting, else return None at once. A message
        spanning several slots is awaited to its end (one withdrawn: to the next message),
        bounded only by ``abort``."""
        buf = self._buf
        count = self._count
        if load(buf, self._written_off)[0] <= count:
            return None
        if WEAK_ORDER:
            acquire_fence()  # that load, before the slot's
        slot = self._slot_offs[count % self._layout.slots]
        nbytes, size = _CHUNK.unpack_from(buf, slot)
        if size != nbytes:
            return self.read(decode, None, abort, assemble)
        view = buf[slot + SLOT_HEADER : slot + SLOT_HEADER + size]
        if self._ends_bulk is not None:
            self._ends_bulk.bulk = False
        try:
            return decode(view)
        finally:
            view.release()
            self._count = count = count + 1
            # Release the slot, then look at the writer's flag (see _wait_for_space).
            if store_fence_load(buf, self._own_off, count, self._waiting_off):
                self._space_bell.ring()
            _buffers.cache.tick()

    def read(
        self,
        decode: Callable[[Received], T],
        deadline: float | None = None,
        abort: Callable[[], None] | None = None,
        assemble: Assemble | None = None,
    ) -> T | None:
        """Wait for the next message and return ``decode(view)``; None if ``deadline`` passed.

        ``decode`` gets a :data:`Received`: it must copy what it keeps out of a memoryview,
        which is only valid during the call. Once the
        first chunk of a message has arrived, the rest is awaited regardless of ``deadline``;
        a message its writer withdrew part-way (see :meth:`RingWriter.write
        <._ring_writer.RingWriter.write>`) is dropped at its mark, and the next one read.
        A message of several slots is copied where ``assemble`` says (see :data:`Assemble`),
        by default into one block of warm memory.
        """
        if not self.wait_readable(deadline, abort):
            return None
        buf = self._buf
        slots = self._layout.slots
        slot = self._slot_offs[self._count % slots]
        nbytes, size = _CHUNK.unpack_from(buf, slot)
        spin = self._spin
        if size == nbytes:
            if self._ends_bulk is not None:
                self._ends_bulk.bulk = False
            view = buf[slot + SLOT_HEADER : slot + SLOT_HEADER + size]
            try:
                return decode(view)
            finally:
                view.release()
                self._release(1)
                _buffers.cache.tick()
        if nbytes == WITHDRAWN:  # a mark whose message this reader joined after: skipped
            self._release(1)
            return self.read(decode, deadline, abort, assemble)
        # Several slots: copy each chunk out as it is published, into memory this reader
        # owns (warm, from the buffer cache, or where ``assemble`` says), releasing its slot
        # at once so that the writer can stream on meanwhile.
        if spin is not None:
            spin.bulk = True
        plan = None
        if assemble is not None:
            first = buf[slot + SLOT_HEADER : slot + SLOT_HEADER + size]
            try:
                plan = assemble(first, nbytes)
            finally:
                first.release()
        received: Received
        if plan is None:
            dests = [_buffers.cache.take(nbytes)]
            received = pickle.PickleBuffer(dests[0])
        else:
            dests, received = plan
        pos, total = 0, nbytes
        try:
            dest_index, dest_pos = 0, 0  # the piece being filled, and bytes filled of it
            while total == nbytes:  # else the writer withdrew it: its mark, not a chunk
                src = slot + SLOT_HEADER
                end = src + size
                while src < end:  # copy this chunk into as many pieces as it spans
                    dest = dests[dest_index]
                    step = min(end - src, len(dest) - dest_pos)
                    if step <= 0:  # an assemble plan shorter than the message
                        raise ValueError("the assembled pieces end before the message")
                    dest[dest_pos : dest_pos + step] = buf[src : src + step]
                    src += step
                    dest_pos += step
                    if dest_pos == len(dest) and dest_index + 1 < len(dests):
                        dest_index, dest_pos = dest_index + 1, 0
                pos += size
                self._release(1)
                if pos >= nbytes:
                    break
                self.wait_readable(None, abort)
                slot = self._slot_offs[self._count % slots]
                total, size = _CHUNK.unpack_from(buf, slot)
        except BaseException:
            self.broken = True  # the rest of this message would be read as new messages
            raise
        del dests
        if pos < nbytes:  # withdrawn (see RingWriter.write): every reader drops it here
            del received, plan
            self._release(1)
            return self.read(decode, deadline, abort, assemble)
        return decode(received)

    def read_held(
        self,
        decode: Callable[[Received], T],
        abort: Callable[[], None] | None = None,
        assemble: Assemble | None = None,
    ) -> T:
        """Wait for the next message and return ``decode`` of it, as :meth:`read` without a
        deadline, except that a message of one slot is handed to ``decode`` as a
        :class:`pickle.PickleBuffer` over this reader's private view of the slot
        (:class:`~._slot_views.SlotViews`): what ``decode`` rebuilds may use it in place, and
        then the slot stays held until :meth:`release_held`, which must come before the next
        read (if nothing ``decode`` returned uses the slot, it is freed at once). A message
        smaller than :data:`IN_PLACE_MIN` is copied, as :meth:`read` does.
        A reader without views reads as :meth:`read` does (release_held is then a no-op)."""
        views = self._views
        self.wait_readable(None, abort)  # no deadline: true once a message is there
        index = self._count % self._nslots
        nbytes, size = _CHUNK.unpack_from(self._buf, self._slot_offs[index])
        if views is None or size != nbytes or size < IN_PLACE_MIN:
            # Copied, as read copies: no views, several slots, or small enough to copy (the
            # message is there: try_read reads it without a second wait).
            item = self.try_read(decode, abort, assemble)
            assert item is not None
            return item
        if self._ends_bulk is not None:
            self._ends_bulk.bulk = False
        held = (index, SLOT_HEADER, SLOT_HEADER + size)
        received = pickle.PickleBuffer(views.view(*held))
        try:
            item = decode(received)
        except BaseException:
            del received
            self._held = held
            self.release_held()
            raise
        del received
        if views.shared(index):  # what it rebuilt uses the slot: hold it until the call ends
            self._held = held
        else:  # nothing was built on the slot (no tensor or array; bytes are copies)
            self._release(1)
            _buffers.cache.tick()
        return item

    def release_held(self) -> None:
        """Free the slot :meth:`read_held` holds, once its call is over and the caller has
        dropped what it decoded: what is still referenced is frozen, what the reader wrote
        is dropped (see :class:`~._slot_views.SlotViews`). Nothing if no slot is held."""
        held, self._held = self._held, None
        if held is None:
            return
        views = self._views
        assert views is not None
        views.settle(*held)
        self._release(1)
        _buffers.cache.tick()

    def _release(self, chunks: int) -> None:
        self._count += chunks
        # Release the slots, then look at the writer's flag (see _wait_for_space).
        if store_fence_load(self._buf, self._own_off, self._count, self._waiting_off):
            self._space_bell.ring()
