"""A single-writer, multi-reader ring of fixed-size slots in shared memory (:class:`Ring`),
and the counter protocol between its writer (:mod:`._ring_writer`) and its readers
(:mod:`._ring_reader`). Where the counters and slots lie in the segment: :mod:`._ring_layout`;
where each end finds them, and its own count: :mod:`._ring_end`.

A message is split into chunks of at most ``slot_bytes``; chunk ``c`` goes to slot
``c % slots``. A message of one chunk is copied and published at once. A larger one starts
once the slots it needs (all of them, if it is bigger than the ring) are free, and each chunk
is published as soon as it is written: readers copy it out and free its slot while the writer
writes the next, and a message bigger than the ring streams through it (the writer waits for
freed slots), so no payload is too big and none is truncated; one the writer stops part-way
is withdrawn by a mark in its next slot (see ``RingWriter.write``): every reader drops it.
Readers copy out what they read before releasing its slots; a message of several chunks goes
into memory the reader owns, warm from the receive buffer cache (``_buffers``) when large. A
reader with private views of the slots (:mod:`._slot_views`: a worker reading its calls)
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

The writer's rows are :class:`~._ring_writer.RingWriter`'s ``_free_slots`` and
``_wait_for_space``, then ``write`` and ``_publish``; the reader's are
:class:`~._ring_reader.RingReader`'s ``poll`` and ``wait_readable``, then ``try_read``,
``read`` and ``_release``.

Memory order (the argument is in docs/memory-ordering.md): every access to ``written``,
``consumed[i]`` and ``writer_waiting`` goes through :mod:`._fence`. The writer stores a
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
"""

from __future__ import annotations

from ._ring_reader import RingReader
from ._ring_writer import RingWriter

__all__ = ["Ring", "RingAbortedError"]


class RingAbortedError(Exception):
    """Raised inside ring waits when the ``abort`` check asks to stop waiting."""


class Ring(RingWriter, RingReader):
    """One side of a ring: the writer (``reader=None``) or reader number ``reader``.

    ``data_bells`` are the readers' doorbells (the writer rings them all; a reader waits on
    its own, passed as a one-item list). ``space_bell`` is rung by readers when they free a
    slot and waited on by the writer.
    """
