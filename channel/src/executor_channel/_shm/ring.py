"""A single-writer, multi-reader ring of fixed-size slots in shared memory (:class:`Ring`: its
writer, or one of its readers), where it lies in the segment (:class:`RingLayout`), and the
counter protocol between the writer and its readers.

A message is split into chunks of at most ``slot_bytes``; chunk ``c`` goes to slot
``c % slots``. A message of one chunk is copied and published at once. A larger one starts
once the slots it needs (all of them, if it is bigger than the ring) are free, and each chunk
is published as soon as it is written: readers copy it out and free its slot while the writer
writes the next, and a message bigger than the ring streams through it (the writer waits for
freed slots), so no payload is too big and none is truncated; one the writer stops part-way
is withdrawn by a mark in its next slot (see ``Ring.write``): every reader drops it.
Readers copy out what they read before releasing its slots; a message of several chunks goes
into memory the reader owns, warm from the receive buffer cache (``_buffers``) when large. A
reader with private views of the slots (:mod:`.slot_views`: a worker reading its calls)
decodes a message of one chunk in place instead, and frees its slot once the call returned.

The counter protocol, per message (a message of ``n`` chunks; reader ``i``):

======================  ==========================  =======================================
who                     step                        counter (order)
======================  ==========================  =======================================
writer                  waits until every reader    loads every ``consumed[i]`` (acquire):
                        freed the slots it needs    ``written - min(consumed) + n <= slots``
                        (all of them, ``n > slots``  (or one at a time while it streams)
                        streams)
writer                  copies chunk ``c`` into     stores ``written += 1`` (release) after
                        slot ``c % slots``          each chunk; rings every data doorbell
reader ``i``            sees a chunk                loads ``written`` (acquire) ``>`` its
                                                    own count
reader ``i``            copies it out (or its call  stores ``consumed[i] += 1`` (release);
                        used it in place), frees it
                                                    rings the space doorbell only if
                                                    ``writer_waiting`` (full fence first)
writer, ring full       sets ``writer_waiting``     full fence, then loads ``consumed`` again
                        and sleeps                  before sleeping on the space doorbell
======================  ==========================  =======================================

The writer's rows are :class:`Ring`'s ``_free_slots`` and ``_wait_for_space``, then
``write`` and ``_publish``; the reader's are ``poll`` and ``wait_readable``, then
``try_read``, ``read`` and ``_release``.

Memory order (the argument is in docs/memory-ordering.md): every access to ``written``,
``consumed[i]`` and ``writer_waiting`` goes through :mod:`.fence`. The writer stores a
slot, then publishes ``written`` with release order; a reader loads ``written`` with acquire
order, then reads the slot. A reader reads a slot, then publishes its ``consumed`` with
release order; the writer loads every ``consumed`` with acquire order, then refills the
slots they free. So a reader never sees a chunk before its bytes, nor a slot refilled under
it, on any CPU (aarch64 included).

Waiting: a reader or writer first spins briefly if its :class:`Spinner` allows (yielding the
CPU each round), then sleeps on a :class:`Doorbell`. The writer rings each reader's data
doorbell after every publish, so readers never miss a message. Readers ring the shared
space doorbell after a release only while the writer says it is waiting (a full ring is
rare; this saves a system call per message). The writer sets that flag, then checks for
space; a reader stores its ``consumed``, then checks the flag; a full fence between the
store and the load on both sides means at least one of them sees the other's store: the
writer finds the space, or the reader rings. So no wake-up is missed, and a writer sleeps
on the doorbell until a reader rings or its deadline passes (re-checking at least every
``MAX_SLEEP_S``). Only a writer given an ``abort`` callback also wakes at short, growing
intervals, to run it: the driver reads replies there while its call ring is full.

Where a ring lies in the segment: its counters' lines, then its slots, each opened by a
chunk header.

Layout of a ring inside the segment (:class:`RingLayout`; counters are native-endian u64,
each on its own 64-byte line)::

    +0                   written: chunks published by the writer
    +8                   writer_waiting: set while the writer waits for a free slot
    +64 * (1 + i)        consumed[i]: chunks reader i has finished with
    slots_offset + k*S   slot k: chunk header (message bytes, chunk bytes) then data, or
                         the header (WITHDRAWN, 0): the message before it was withdrawn
"""

from __future__ import annotations

import pickle
import struct
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import attrs

from .._codec import STREAM_CHUNK, Assembled
from .._memory import buffers as _buffers
from .doorbell import Doorbell
from .fence import (
    WEAK_ORDER,
    acquire_fence,
    fence_seq_cst,
    load,
    load_acquire,
    store_fence_load,
    store_release,
)
from .spin import Spinner

if TYPE_CHECKING:
    from .slot_views import SlotViews

__all__ = [
    "CHUNK",
    "IN_PLACE_MIN",
    "LINE",
    "MAX_SLEEP_S",
    "SLOT_HEADER",
    "WITHDRAWN",
    "Assemble",
    "Received",
    "Ring",
    "RingAbortedError",
    "RingLayout",
]

T = TypeVar("T")

#: A slot's chunk header: the message's bytes, and the bytes of it in this chunk.
CHUNK = struct.Struct("<QQ")
#: Each counter's line.
LINE = 64
#: Where a slot's data starts.
SLOT_HEADER = 64
#: A chunk header's message bytes that mean: the message this slot continues was withdrawn
#: (its writer stopped part-way, see Ring.write): readers drop what they have of it.
WITHDRAWN = (1 << 64) - 1


#: Longest single sleep; waits re-check their abort condition at least this often.
MAX_SLEEP_S = 0.1


#: While a writer with an ``abort`` callback waits for a free slot, the callback runs at
#: this growing interval (the driver reads replies in it: a worker blocked on a full reply
#: ring frees its call slot only after that, and nothing rings the space doorbell for it).
_CALLBACK_FIRST_S = 0.0005
_CALLBACK_MAX_S = 0.05


def _never() -> None:
    return None


#: :meth:`Ring.read_held` reads a message in place from this size: below it, copying
#: what the message carries costs less than holding its slot and checking its pages after
#: the call (figures: docs/benchmarks.md, "Calls read in place").
IN_PLACE_MIN = 64 << 10


#: What a reader's ``decode`` gets: a view of the slot for a message of one slot (valid only
#: during the call: copy what you keep), a PickleBuffer over memory the reader owns for a
#: message that spanned several slots (it was copied out once; keep it as it is), or an
#: :class:`Assembled` message when the reader's ``assemble`` placed it.
Received = memoryview | pickle.PickleBuffer | Assembled
#: ``assemble(first_chunk, message_bytes)``: where to copy a message of several slots, as
#: writable views that follow one another through the message and together cover it, and what
#: ``decode`` gets once they are filled; None to copy it into one block of the buffer cache.
Assemble = Callable[[memoryview, int], "tuple[list[memoryview], Assembled] | None"]


class RingAbortedError(Exception):
    """Raised inside ring waits when the ``abort`` check asks to stop waiting."""


class Ring:
    """One side of a ring: the writer (``reader=None``) or reader number ``reader``.

    ``data_bells`` are the readers' doorbells (the writer rings them all; a reader waits on
    its own, passed as a one-item list). ``space_bell`` is rung by readers when they free a
    slot and waited on by the writer.
    """

    def __init__(
        self,
        buf: memoryview,
        layout: RingLayout,
        *,
        reader: int | None,
        data_bells: Sequence[Doorbell],
        space_bell: Doorbell,
        spin: Spinner | None = None,
        wait_spin_s: float | None = None,
        ends_bulk: bool = True,
        views: SlotViews | None = None,
    ) -> None:
        self._buf = buf
        #: A reader's private views of the slots, to decode a message in place (see
        #: :meth:`Ring.read_held`); None: it copies.
        self._views = views
        #: The slot :meth:`Ring.read_held` holds, and the bytes of it read in place.
        self._held: tuple[int, int, int] | None = None
        #: Which spinner a message of one slot on this ring takes out of its ``bulk`` state
        #: (see :meth:`Spinner.contended`): on a ring of calls, a small call starts a new
        #: exchange; a small reply (``ends_bulk=False``) may answer a large call that the
        #: other readers are still copying.
        self._ends_bulk = spin if ends_bulk else None
        #: A reader's spin while it waits for its next message (default: ``spin``'s own).
        self._wait_spin_s = wait_spin_s
        self._layout = layout
        self._reader = reader
        self._spin = spin
        self._data_bells = list(data_bells)
        self._space_bell = space_bell
        self._written_off = layout.offset
        self._waiting_off = layout.offset + 8
        self._consumed_offs = [layout.offset + LINE * (1 + i) for i in range(layout.readers)]
        self._slot_data = layout.slot_bytes
        self._nslots = layout.slots
        #: Writer: a message stopped part-way whose end mark is owed (see Ring.write).
        self._withdrawn = False
        #: A reader interrupted part-way through a message of several slots: it cannot go on.
        self.broken = False
        self._slot_offs = [
            layout.slots_offset + k * layout.slot_stride for k in range(layout.slots)
        ]
        # This side's own count: chunks written (writer) or consumed (reader).
        self._own_off = self._written_off if reader is None else self._consumed_offs[reader]
        self._count: int = load_acquire(buf, self._own_off)[0]
        #: Writer: slots known to be free (a lower bound: readers only ever free more), so
        #: that the readers' counters are loaded only when it runs out.
        self._free = 0

    def resume_reader(self, index: int) -> None:
        """A reader's process was replaced (rank replacement): on the writer's side, count
        reader ``index`` as having read everything written, so that the new reader starts at
        the next message and no slot waits for the dead one; on that ring's reader's side
        (``index`` is this reader), skip whatever its dead writer left, whole or half
        written, so that a new writer starts clean. Only while nothing is written or read
        on this ring (the executor is recovering)."""
        buf = self._buf
        if self._reader is None:
            store_release(buf, self._consumed_offs[index], self._count)
            self._free = 0  # look at the counters again before the next write
        else:
            if index != self._reader:
                raise ValueError(f"reader {self._reader} cannot resume reader {index}")
            self._count = load_acquire(buf, self._written_off)[0]
            store_release(buf, self._own_off, self._count)
            store_release(buf, self._waiting_off, 0)
            self.broken = False  # a message its dead writer left half-written is skipped

    @property
    def spinner(self) -> Spinner | None:
        """The spin budget this side's waits use (None: they never spin)."""
        return self._spin

    # The writer's side.

    def _free_slots(self) -> int:
        """Load every reader's ``consumed`` (acquire: the slots they free are refilled only
        after) and return how many slots are free; also kept as ``_free``."""
        buf = self._buf
        count = self._count
        lowest = count
        for off in self._consumed_offs:
            consumed: int = load(buf, off)[0]
            if consumed < lowest:
                lowest = consumed
        if WEAK_ORDER:
            acquire_fence()  # the loads above, before any store into the slots they free
        self._free = free = self._nslots - (count - lowest)
        return free

    def _wait_for_space(
        self,
        needed: int,
        deadline: float | None,
        abort: Callable[[], None],
        small: bool = False,
    ) -> bool:
        """Wait until ``needed`` slots are free; False if ``deadline`` passed first.
        ``small``: for a message of one slot (see :meth:`Spinner.contended`). The mark that
        ends a withdrawn message (see :meth:`write`) goes first, in a slot of its own."""
        if self._withdrawn:
            try:
                if not self._wait_free(1, deadline, abort):
                    return False
                slot = self._slot_offs[self._count % self._nslots]
                CHUNK.pack_into(self._buf, slot, WITHDRAWN, 0)  # the mark, then publish it:
                self._publish(1)  # (one published twice is skipped: see Ring.read)
                self._withdrawn = False
            finally:  # an exception before the mark is out: the next write comes here again
                self._free = 0 if self._withdrawn else self._free
        return self._wait_free(needed, deadline, abort, small)

    def _wait_free(
        self, needed: int, deadline: float | None, abort: Callable[[], None], small: bool = False
    ) -> bool:
        if self._free_slots() >= needed:
            return True
        bell = self._space_bell
        spin = self._spin
        spin_until = spin.start() if spin is not None else 0.0
        waiting = False
        # Readers ring when they free a slot, so a wait without a callback sleeps until then
        # (or the deadline); one with a callback also wakes to run it (see _CALLBACK_FIRST_S).
        nap = MAX_SLEEP_S if abort is _never else _CALLBACK_FIRST_S
        try:
            while True:
                abort()
                if self._free_slots() >= needed:
                    return True
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return False
                if now < spin_until and spin is not None:
                    if spin.pause():
                        continue
                    spin_until = 0.0
                    if self._free_slots() >= needed:  # freed while this process was off
                        if small:  # the CPU: the spin delayed a small message
                            spin.contended()
                        return True
                spin_until = 0.0
                if not waiting:
                    waiting = True
                    store_release(self._buf, self._waiting_off, 1)
                    # Store, then load (see :mod:`.ring`'s docstring): either this check sees the
                    # reader's release, or that reader sees the flag and rings.
                    fence_seq_cst()
                    if self._free_slots() >= needed:
                        return True
                bell.wait(nap if deadline is None else min(nap, deadline - now))
                nap = min(nap * 2, MAX_SLEEP_S if abort is _never else _CALLBACK_MAX_S)
        finally:
            if waiting:
                store_release(self._buf, self._waiting_off, 0)

    def write(
        self,
        parts: Sequence[memoryview | bytes],
        nbytes: int,
        deadline: float | None = None,
        abort: Callable[[], None] = _never,
        *,
        finish_by: float | None = None,
        copied: bool = False,
    ) -> bool:
        """Publish the message made of ``parts`` (``nbytes`` in all) to every reader.

        ``copied``: no reader reads this message in place (see :meth:`read_held`), so one
        larger than :data:`STREAM_CHUNK` is streamed in chunks even if it fits one slot.
        Otherwise a message is written whole into one slot if it fits; a larger one is
        always streamed.

        False if the slots it needs did not free up before ``deadline``, or if a streamed
        message was not finished by ``finish_by`` (a reader stopped freeing slots; None: no
        bound but ``abort``). A message stopped part-way (so, or by an exception: ``abort``'s,
        Ctrl-C) is withdrawn: the next write first publishes a mark (``WITHDRAWN``, see
        :class:`RingLayout`) in the slot its next chunk would have taken. Every reader reads
        the same slots in order, so each drops the part it got at the mark: none hands it
        on, and the ring stays in step.
        """
        buf = self._buf
        if nbytes <= self._slot_data and (not copied or nbytes <= STREAM_CHUNK):
            # The common case, kept short (no extra calls).
            if self._free < 1 and not self._wait_for_space(1, deadline, abort, True):
                return False
            count = self._count
            slot = self._slot_offs[count % self._nslots]
            CHUNK.pack_into(buf, slot, nbytes, nbytes)
            pos = slot + SLOT_HEADER
            for part in parts:
                end = pos + len(part)
                buf[pos:end] = part
                pos = end
            self._count = count = count + 1
            self._free -= 1
            store_release(buf, self._written_off, count)  # publish, then ring
            for bell in self._data_bells:
                bell.ring()
            if self._ends_bulk is not None:
                self._ends_bulk.bulk = False
            return True
        if self._spin is not None:
            self._spin.bulk = True
        nchunks = -(-nbytes // min(self._slot_data, STREAM_CHUNK))
        needed = min(nchunks, self._nslots)
        if self._free < needed and not self._wait_for_space(needed, deadline, abort):
            return False
        start, done = self._count, False
        try:
            # Chunks of one size (the last may be shorter), as few as the limit allows.
            done = self._stream(parts, nbytes, nchunks, -(-nbytes // nchunks), finish_by, abort)
        finally:
            if not done:  # withdrawn: what was counted but not published is taken back (an
                # exception may come in between), and the mark is owed if some was published
                written: int = load(buf, self._written_off)[0]
                self._count, self._free = written, 0
                self._withdrawn = start < written < start + nchunks
        return done

    def _stream(
        self,
        parts: Sequence[memoryview | bytes],
        nbytes: int,
        nchunks: int,
        chunk_bytes: int,
        finish_by: float | None,
        abort: Callable[[], None],
    ) -> bool:
        # Each chunk is published as soon as it is written, so readers copy it out while
        # the next one is written: the copies overlap instead of taking turns. False: a
        # reader did not free the slot the next chunk needs by ``finish_by``.
        nslots = self._nslots
        buf = self._buf
        part_index, part_pos = 0, 0
        remaining = nbytes
        views = [memoryview(p) for p in parts]
        for _chunk in range(nchunks):
            # write() made sure of the first ``nslots``.
            if self._free < 1 and not self._wait_free(1, finish_by, abort):
                return False
            slot = self._slot_offs[self._count % nslots]
            size = min(chunk_bytes, remaining)
            CHUNK.pack_into(buf, slot, nbytes, size)
            pos = slot + SLOT_HEADER
            end = pos + size
            while pos < end:
                part = views[part_index]
                take = min(part.nbytes - part_pos, end - pos)
                buf[pos : pos + take] = part[part_pos : part_pos + take]
                pos += take
                part_pos += take
                if part_pos == part.nbytes:
                    part_index, part_pos = part_index + 1, 0
            remaining -= size
            self._publish(1)
        return True

    def _publish(self, chunks: int) -> None:
        self._count += chunks
        self._free -= chunks
        store_release(self._buf, self._written_off, self._count)
        for bell in self._data_bells:
            bell.ring()

    # A reader's side.

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
        nbytes, size = CHUNK.unpack_from(self._buf, slot)
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
        nbytes, size = CHUNK.unpack_from(buf, slot)
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
        which is only valid during the call. Once the first chunk of a message has arrived,
        the rest is awaited regardless of ``deadline``; a message its writer withdrew
        part-way (see :meth:`write`) is dropped at its mark, and the next one read.
        A message of several slots is copied where ``assemble`` says (see :data:`Assemble`),
        by default into one block of warm memory.
        """
        if not self.wait_readable(deadline, abort):
            return None
        buf = self._buf
        slots = self._layout.slots
        slot = self._slot_offs[self._count % slots]
        nbytes, size = CHUNK.unpack_from(buf, slot)
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
                total, size = CHUNK.unpack_from(buf, slot)
        except BaseException:
            self.broken = True  # the rest of this message would be read as new messages
            raise
        del dests
        if pos < nbytes:  # withdrawn (see Ring.write): every reader drops it here
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
        (:class:`~.slot_views.SlotViews`): what ``decode`` rebuilds may use it in place, and
        then the slot stays held until :meth:`release_held`, which must come before the next
        read (if nothing ``decode`` returned uses the slot, it is freed at once). A message
        smaller than :data:`IN_PLACE_MIN` is copied, as :meth:`read` does.
        A reader without views reads as :meth:`read` does (release_held is then a no-op)."""
        views = self._views
        self.wait_readable(None, abort)  # no deadline: true once a message is there
        index = self._count % self._nslots
        nbytes, size = CHUNK.unpack_from(self._buf, self._slot_offs[index])
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
        is dropped (see :class:`~.slot_views.SlotViews`). Nothing if no slot is held."""
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


@attrs.frozen
class RingLayout:
    """Where a ring lives in the segment and how it is shaped."""

    offset: int
    readers: int
    slots: int
    slot_bytes: int

    @property
    def slots_offset(self) -> int:
        return self.offset + _align(LINE * (1 + self.readers), 4096)

    @property
    def slot_stride(self) -> int:
        return _align(SLOT_HEADER + self.slot_bytes, 4096)

    @property
    def nbytes(self) -> int:
        return self.slots_offset - self.offset + self.slots * self.slot_stride


def _align(value: int, to: int) -> int:
    return (value + to - 1) // to * to
