"""A ring's writer (:class:`RingWriter`): it waits for free slots, copies a message into
them and publishes it to every reader, a message of several slots streamed chunk by chunk.

Its steps are the writer's rows of the counter protocol in :mod:`._ring`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from . import _ring_layout
from ._fence import WEAK_ORDER, acquire_fence, fence_seq_cst, load, store_release
from ._ring_end import MAX_SLEEP_S, RingEnd
from ._ring_layout import SLOT_HEADER, WITHDRAWN

__all__ = ["STREAM_CHUNK", "RingWriter"]

#: The slot header's struct, bound here rather than imported by name: CPython compiles a
#: method call on an imported name as an attribute load, a bound method made on each call.
_CHUNK = _ring_layout.CHUNK

#: While a writer with an ``abort`` callback waits for a free slot, the callback runs at
#: this growing interval (the driver reads replies in it: a worker blocked on a full reply
#: ring frees its call slot only after that, and nothing rings the space doorbell for it).
_CALLBACK_FIRST_S = 0.0005
_CALLBACK_MAX_S = 0.05

#: A message that its readers copy out (one larger than a slot, or one the writer says is
#: ``copied``) is streamed in chunks of at most this size: each reader copies one chunk
#: while the next is written, instead of starting once the whole message is in. Smaller
#: chunks overlap more and cost more wake-ups (figures: docs/benchmarks.md, "Calls read in
#: place").
STREAM_CHUNK = 4 << 20


def _never() -> None:
    return None


class RingWriter(RingEnd):
    """The writer's methods of a :class:`~._ring.Ring`."""

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
                _CHUNK.pack_into(self._buf, slot, WITHDRAWN, 0)  # the mark, then publish it:
                self._publish(1)  # (one published twice is skipped: see RingReader.read)
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
                    # Store, then load (see :mod:`._ring`'s docstring): either this check sees the
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

        ``copied``: no reader reads this message in place (see :meth:`RingReader.read_held
        <._ring_reader.RingReader.read_held>`), so one larger than :data:`STREAM_CHUNK` is
        streamed in chunks even if it fits one slot. Otherwise a message is written whole
        into one slot if it fits; a larger one is always streamed.

        False if the slots it needs did not free up before ``deadline``, or if a streamed
        message was not finished by ``finish_by`` (a reader stopped freeing slots; None: no
        bound but ``abort``). A message stopped part-way (so, or by an exception: ``abort``'s,
        Ctrl-C) is withdrawn: the next write first publishes a mark (``WITHDRAWN``, see
        :mod:`._ring_layout`) in the slot its next chunk would have taken. Every reader reads
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
            _CHUNK.pack_into(buf, slot, nbytes, nbytes)
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
            _CHUNK.pack_into(buf, slot, nbytes, size)
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
