"""What a ring's writer and its readers share: where this end finds the ring's counters and
slots in the segment, its own count, its doorbells and its spinner (:class:`RingEnd`).

The writer's side is :mod:`._ring_writer`, a reader's :mod:`._ring_reader`; :mod:`._ring`
joins them and states the counter protocol between them.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._doorbell import Doorbell
from ._fence import load_acquire, store_release
from ._ring_layout import LINE, RingLayout
from ._slot_views import SlotViews
from ._spin import Spinner

__all__ = ["MAX_SLEEP_S", "RingEnd"]

#: Longest single sleep; waits re-check their abort condition at least this often.
MAX_SLEEP_S = 0.1


class RingEnd:
    """One end of a ring: the writer (``reader=None``) or reader number ``reader``, as
    :class:`~._ring.Ring` takes them."""

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
        #: :meth:`RingReader.read_held`); None: it copies.
        self._views = views
        #: The slot :meth:`RingReader.read_held` holds, and the bytes of it read in place.
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
        #: Writer: a message stopped part-way whose end mark is owed (see RingWriter.write).
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

    def fits_one_slot(self, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` is published at once, in a single slot."""
        return nbytes <= self._slot_data
