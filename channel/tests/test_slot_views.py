"""Calls read in place (SlotViews, Ring.read_held): a tensor argument is not copied out
of its slot, yet each reader's argument is its own, what a reader keeps never changes, a later
message is read as written, and the slot is held only while its call runs."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from channel_helpers import RingEnds

from executor_channel import Received, encode
from executor_channel._codec import decode
from executor_channel._memory import buffers as _buffers
from executor_channel._shm import slot_views as _slot_views
from executor_channel._shm.ring import IN_PLACE_MIN, RingLayout
from executor_channel._shm.segment import SharedSegment
from executor_channel._shm.slot_views import SlotViews

torch = pytest.importorskip("torch")

KIB = 1 << 10
MIB = 1 << 20
WAIT = 10.0  # every wait in these tests is bounded by this


class Rings(RingEnds):
    """A writer and ``readers`` readers on one ring, each reader with its own slot views."""

    def __init__(self, slots: int, slot_bytes: int, readers: int = 2) -> None:
        super().__init__(slots, slot_bytes, readers, views=True)
        assert all(views is not None for views in self.views), "this machine reads pagemap"

    def send(self, value: Any, wait: float = WAIT) -> bool:
        return self.writer.write(*encode(4, True, 0, 1, value), deadline=time.monotonic() + wait)


@pytest.fixture
def rings() -> Iterator[Rings]:
    made = Rings(slots=2, slot_bytes=MIB)
    yield made
    made.close()


def _body(view: Received) -> Any:
    return decode(view)[4]


def _inside(tensor: Any, views: SlotViews, slot: int) -> bool:
    mapping = views._maps[slot]
    assert mapping is not None
    start = views._addresses[slot]
    return start <= tensor.data_ptr() < start + len(mapping)


def test_a_tensor_is_read_in_place_and_its_slot_held_until_released(rings: Rings) -> None:
    sent = torch.arange(64 * KIB, dtype=torch.float32)  # 256 KiB
    assert rings.send(sent)
    reader, views = rings.readers[0], rings.views[0]
    got = reader.read_held(_body)
    assert torch.equal(got, sent)
    assert _inside(got, views, 0)  # built on the slot: no copy
    assert got.numpy().flags.writeable
    # Held: the writer fills the other slot, then finds none free for a third message.
    rings.readers[1].read_held(_body)
    rings.readers[1].release_held()
    assert rings.send(1)
    assert not rings.send(2, wait=0.05)
    del got
    reader.release_held()
    assert rings.send(2)
    assert (views.kept, views.written) == (0, 0)


def test_a_message_with_nothing_out_of_band_frees_its_slot_at_once(rings: Rings) -> None:
    for value in ("a", "b"):
        assert rings.send(value)
        for reader in rings.readers:
            assert reader.read_held(_body) == value  # no release_held: nothing to hold
    assert rings.send("c", wait=0.05)  # both slots were free


def test_a_small_message_is_copied_and_frees_its_slot_at_once(rings: Rings) -> None:
    small = torch.rand(IN_PLACE_MIN // 8)  # half the size read in place
    for _ in range(2):
        assert rings.send(small)
        for reader, views in zip(rings.readers, rings.views, strict=True):
            got = reader.read_held(_body)
            assert torch.equal(got, small)
            assert views is not None
            assert not any(views.shared(slot) for slot in (0, 1))  # a copy of its own
    assert rings.send(small, wait=0.05)  # both slots were free


def test_an_in_place_write_is_the_writers_alone_and_later_messages_read_as_written(
    rings: Rings,
) -> None:
    size = 3 * 64 * KIB  # 192 KiB
    for round_ in range(4):  # both slots, twice
        assert rings.send(torch.full((size // 4,), float(round_)))
        mine = rings.readers[0].read_held(_body)
        theirs = rings.readers[1].read_held(_body)
        mine[1000:3000].mul_(-7.0)  # a worker's in-place operation on its argument
        assert bool((theirs == float(round_)).all())
        assert float(mine[2000]) == -7.0 * round_
        del mine, theirs
        for reader in rings.readers:
            reader.release_held()
    assert rings.views[0].written == 4
    assert rings.views[1].written == 0


def test_a_kept_tensor_never_changes_and_never_holds_its_slot(rings: Rings) -> None:
    assert rings.send(torch.full((MIB // 8,), 1.0))  # 512 KiB
    kept = rings.readers[0].read_held(_body)
    part = kept[100:200]  # a view keeps the memory too
    rings.readers[0].release_held()
    rings.readers[1].read_held(_body)
    rings.readers[1].release_held()
    assert rings.views[0].kept == 1
    for value in (2.0, 3.0, 4.0, 5.0):  # every slot refilled, twice
        assert rings.send(torch.full((MIB // 8,), value), wait=1.0)
        for reader in rings.readers:
            got = reader.read_held(_body)
            assert bool((got == value).all())
            del got
            reader.release_held()
    assert bool((kept == 1.0).all())
    assert bool((part == 1.0).all())
    kept.add_(1.0)  # still its own memory: writable, and nobody else's
    assert bool((part == 2.0).all())


def test_bytes_and_several_slot_messages_are_copied_as_before(rings: Rings) -> None:
    data = bytes(range(256)) * 1024  # large bytes travel out of band, become a bytes copy
    assert rings.send(data)
    for reader in rings.readers:
        assert reader.read_held(_body) == data
        reader.release_held()
    big = torch.rand(3 * MIB // 4)  # 3 MiB: several slots, streamed and copied out
    got: list[Any] = [None, None]

    def read(index: int) -> None:
        got[index] = rings.readers[index].read_held(_body)

    # Each reader in its own thread: the writer streams through the ring as both free slots.
    threads = [threading.Thread(target=read, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    assert rings.send(big)
    for thread in threads:
        thread.join(WAIT)
    assert all(torch.equal(g, big) for g in got)
    assert not any(rings.views[0].shared(slot) for slot in (0, 1))  # the reader's own copy


def test_without_pagemap_a_reader_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = RingLayout(0, 1, 2, MIB)
    segment = SharedSegment.create(layout.nbytes)
    real_open = os.open

    def refuse(path: str, *args: Any) -> int:
        if path == "/proc/self/pagemap":
            raise PermissionError(path)
        return real_open(path, *args)

    try:
        monkeypatch.setattr(_slot_views, "_pagemap", None)  # not opened yet in this process
        monkeypatch.setattr("os.open", refuse)
        assert SlotViews.open(segment.fd, layout) is None
    finally:
        monkeypatch.undo()
        segment.close()


def test_every_ring_of_a_process_shares_one_pagemap_descriptor() -> None:
    first, second = Rings(2, 64 * KIB), Rings(2, 64 * KIB)
    try:
        assert first.views[0]._pagemap == second.views[1]._pagemap
        before = len(os.listdir("/proc/self/fd"))
        Rings(2, 64 * KIB).close()  # a segment's descriptor comes and goes, nothing else
        assert len(os.listdir("/proc/self/fd")) == before
    finally:
        first.close()
        second.close()


def test_a_large_call_read_in_place_takes_no_warm_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = _buffers.BufferCache()
    monkeypatch.setattr(_buffers, "cache", fresh)
    ring = Rings(slots=2, slot_bytes=2 * MIB, readers=1)
    try:
        assert ring.send(torch.rand(3 * MIB // 8))  # 1.5 MiB: a copy would take a block
        got = ring.readers[0].read_held(_body)
        assert fresh.stats()[1] == 0
        assert _inside(got, ring.views[0], 0)
        del got
        ring.readers[0].release_held()
    finally:
        ring.close()
        fresh.release()
