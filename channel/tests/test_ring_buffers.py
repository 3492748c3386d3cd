"""Messages of several slots and the receive buffer cache: every size arrives whole, a received
object never shares memory with a later message, and cached memory is bounded and given back."""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from channel_helpers import RingEnds

from executor_channel import Received, encode
from executor_channel._codec import STREAM_CHUNK, decode
from executor_channel._memory import buffer_cache as _buffer_cache
from executor_channel._memory import buffers as _buffers

MIB = 1 << 20
WAIT = 10.0  # every wait in these tests is bounded by this


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[_buffers.BufferCache]:
    """A cache of this test's own, used by the rings and the codec while the test runs."""
    fresh = _buffers.BufferCache()
    monkeypatch.setattr(_buffers, "cache", fresh)
    yield fresh
    fresh.release()


class Rings(RingEnds):
    """A writer and ``readers`` readers on one ring in a fresh segment."""

    def __init__(self, slots: int, slot_bytes: int, readers: int = 1) -> None:
        super().__init__(slots, slot_bytes, readers)

    def send(self, parts: list[Any], nbytes: int, copied: bool = False) -> threading.Thread:
        """Write in a thread (a message bigger than the ring needs the readers meanwhile)."""
        errors: list[BaseException] = []

        def write() -> None:
            try:
                deadline = time.monotonic() + WAIT
                assert self.writer.write(parts, nbytes, deadline=deadline, copied=copied)
            except BaseException as exc:
                errors.append(exc)
                raise

        thread = threading.Thread(target=write)
        thread.errors = errors  # type: ignore[attr-defined]
        thread.start()
        return thread

    def transfer(
        self,
        decode_fn: Callable[[Received], Any],
        parts: list[Any],
        nbytes: int,
        copied: bool = False,
    ) -> Any:
        """Send one message and read it with the first reader."""
        thread = self.send(parts, nbytes, copied)
        try:
            result = self.readers[0].read(decode_fn, deadline=time.monotonic() + WAIT)
        finally:
            thread.join(WAIT)
        assert not thread.is_alive()
        assert not thread.errors  # type: ignore[attr-defined]
        return result


@pytest.fixture
def rings() -> Iterator[Callable[..., Rings]]:
    made: list[Rings] = []

    def make(slots: int, slot_bytes: int, readers: int = 1) -> Rings:
        made.append(Rings(slots, slot_bytes, readers))
        return made[-1]

    yield make
    for ring in made:
        ring.close()


def _frame(value: Any) -> tuple[list[Any], int]:
    return encode(4, True, 0, 1, value)


def _body(view: Received) -> Any:
    return decode(view)[4]


# --- sizes --------------------------------------------------------------------------------


@pytest.mark.usefixtures("cache")
@pytest.mark.parametrize("offset", [-1, 0, 1])
@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 7])
def test_sizes_straddling_slot_boundaries(
    rings: Callable[..., Rings], chunks: int, offset: int
) -> None:
    # 3 slots of 1 MiB: one slot, several, the whole ring, and more than the ring (streamed).
    ring = rings(3, MIB)
    payload = os.urandom(chunks * MIB + offset)
    assert ring.transfer(bytes, [payload], len(payload)) == payload
    assert not ring.writer.broken
    assert not ring.readers[0].broken


@pytest.mark.usefixtures("cache")
def test_a_message_in_many_parts_across_chunks(rings: Callable[..., Rings]) -> None:
    ring = rings(2, MIB)
    parts = [os.urandom(n) for n in (10, MIB - 3, 7, 3 * MIB + 1, 0, 5)]
    total = sum(len(p) for p in parts)
    assert ring.transfer(bytes, parts, total) == b"".join(parts)


@pytest.mark.usefixtures("cache")
def test_every_reader_gets_the_whole_streamed_message(rings: Callable[..., Rings]) -> None:
    ring = rings(2, MIB, readers=3)
    payload = os.urandom(9 * MIB + 123)
    thread = ring.send([payload], len(payload))
    got: list[bytes] = [b""] * 3

    def read(i: int) -> None:
        got[i] = ring.readers[i].read(bytes, deadline=time.monotonic() + WAIT) or b""

    readers = [threading.Thread(target=read, args=(i,)) for i in range(3)]
    for reader in readers:
        reader.start()
    for reader in [*readers, thread]:
        reader.join(WAIT)
    assert got == [payload] * 3


@pytest.mark.usefixtures("cache")
@pytest.mark.parametrize("stop", ["finish_by", "interrupt"])
def test_a_message_stopped_part_way_is_dropped_by_every_reader(
    rings: Callable[..., Rings], stop: str
) -> None:
    # Reader 0 reads as the chunks come, reader 1 is busy: two chunks fill the ring and the
    # writer gives up on the rest (its deadline, or an exception). Each reader drops the part
    # it got at the withdrawn message's mark, which the next write puts out first.
    ring = rings(2, MIB, readers=2)
    payload = os.urandom(5 * MIB)
    got: list[bytes | None] = []

    def read(i: int) -> threading.Thread:
        thread = threading.Thread(
            target=lambda: got.append(ring.readers[i].read(bytes, time.monotonic() + WAIT))
        )
        thread.start()
        return thread

    def interrupt() -> None:
        raise KeyboardInterrupt

    first = read(0)
    if stop == "finish_by":
        assert not ring.writer.write([payload], len(payload), finish_by=time.monotonic() + 0.3)
    else:
        with pytest.raises(KeyboardInterrupt):
            ring.writer.write([payload], len(payload), None, interrupt)
    second = read(1)
    assert ring.writer.write([b"next"], 4, time.monotonic() + WAIT)
    for thread in (first, second):
        thread.join(WAIT)
    assert got == [b"next", b"next"]
    assert not any(end.broken for end in (ring.writer, *ring.readers))
    # A reader that starts after the message's start (a replaced rank) skips its mark alone.
    assert not ring.writer.write([payload], len(payload), finish_by=time.monotonic() + 0.1)
    ring.readers[1].resume_reader(1)
    threads = [read(0), read(1)]
    assert ring.writer.write([b"last"], 4, time.monotonic() + WAIT)
    for thread in threads:
        thread.join(WAIT)
    assert got[2:] == [b"last", b"last"]


@pytest.mark.usefixtures("cache")
@pytest.mark.parametrize("copied", [False, True])
def test_a_copied_message_streams_even_if_it_fits_one_slot(
    rings: Callable[..., Rings], copied: bool
) -> None:
    # A message the readers copy anyway is streamed in chunks of at most STREAM_CHUNK, so that
    # they copy one while the next is written; any other that fits a slot is written whole.
    ring = rings(4, 3 * STREAM_CHUNK)
    payload = os.urandom(2 * STREAM_CHUNK + 5)
    kind, data = ring.transfer(lambda v: (type(v), bytes(v)), [payload], len(payload), copied)
    assert data == payload
    # Streamed: copied out of 3 chunks, into memory the reader owns; whole: a view of a slot.
    assert kind is (pickle.PickleBuffer if copied else memoryview)
    assert ring.readers[0]._count == (3 if copied else 1)
    small = os.urandom(STREAM_CHUNK)  # at most one chunk: written whole either way
    assert ring.transfer(type, [small], len(small), copied) is memoryview


@pytest.mark.usefixtures("cache")
def test_a_message_larger_than_a_slot_streams_in_chunks_of_at_most_stream_chunk(
    rings: Callable[..., Rings],
) -> None:
    ring = rings(2, 2 * STREAM_CHUNK)
    payload = os.urandom(2 * STREAM_CHUNK + 1)  # 3 chunks of STREAM_CHUNK or less, not 2
    assert ring.transfer(bytes, [payload], len(payload)) == payload
    assert ring.readers[0]._count == 3


@pytest.mark.usefixtures("cache")
def test_tensor_bigger_than_the_default_ring(rings: Callable[..., Rings]) -> None:
    torch = pytest.importorskip("torch")
    ring = rings(4, 16 * MIB)  # the mp backend's default broadcast ring: 64 MiB
    tensor = torch.rand(66 * MIB // 4 + 3)  # more than the ring: streamed through it
    (back,) = ring.transfer(_body, *_frame((tensor,)))
    assert torch.equal(back, tensor)
    assert back.numpy().flags.writeable


# --- ownership ----------------------------------------------------------------------------


def test_received_tensor_stays_intact_after_later_messages(
    rings: Callable[..., Rings], cache: _buffers.BufferCache
) -> None:
    torch = pytest.importorskip("torch")
    ring = rings(2, MIB)
    first = torch.full((3 * MIB // 4,), 1.0)
    kept = ring.transfer(_body, *_frame(first))
    for value in (2.0, 3.0, 4.0):  # same size: would reuse the first block if it were free
        other = ring.transfer(_body, *_frame(torch.full((3 * MIB // 4,), value)))
        assert bool((other == value).all())
        assert other.data_ptr() != kept.data_ptr()
        del other
    assert torch.equal(kept, first)
    # A view of the received tensor keeps its memory too.
    part = kept[10:20]
    address = kept.data_ptr()
    del kept
    later = ring.transfer(_body, *_frame(torch.full((3 * MIB // 4,), 5.0)))
    later_address = later.data_ptr()
    assert later_address != address
    assert bool((part == 1.0).all())
    del later, part
    # Once nothing refers to it, a block is reused: the point of the cache.
    again = ring.transfer(_body, *_frame(torch.full((3 * MIB // 4,), 6.0)))
    assert again.data_ptr() in (address, later_address)
    assert bool((again == 6.0).all())
    assert cache.stats()[1] > 0
    del again
    assert cache.stats()[1] == 0


def test_blocks_are_reused_once_free(
    rings: Callable[..., Rings], cache: _buffers.BufferCache
) -> None:
    np = pytest.importorskip("numpy")
    ring = rings(2, MIB)
    array = np.arange(5 * MIB // 8, dtype=np.float64)
    addresses = set()
    for _ in range(5):
        (back,) = ring.transfer(_body, *_frame((array,)))
        np.testing.assert_array_equal(back, array)
        assert back.flags.writeable
        addresses.add(back.__array_interface__["data"][0])
        del back
    assert len(addresses) == 1  # one warm block, reused every time
    assert len(cache._blocks) == 1


def test_several_objects_of_one_message_share_its_block(
    rings: Callable[..., Rings], cache: _buffers.BufferCache
) -> None:
    torch = pytest.importorskip("torch")
    np = pytest.importorskip("numpy")
    ring = rings(2, MIB)
    tensor, array, data = torch.rand(MIB // 4), np.ones(MIB // 8), os.urandom(MIB)
    got_tensor, got_array, got_data = ring.transfer(_body, *_frame((tensor, array, data)))
    del got_array, got_data
    ring.transfer(_body, *_frame((torch.zeros(MIB // 4), np.zeros(MIB // 8), bytes(MIB))))
    assert torch.equal(got_tensor, tensor)  # the block was still in use through the tensor
    assert cache.stats()[1] > 0


def test_large_buffer_of_a_one_slot_message_is_copied_into_the_cache(
    cache: _buffers.BufferCache,
) -> None:
    # The slot is reused as soon as decode returns: the tensor must own a copy.
    torch = pytest.importorskip("torch")
    tensor = torch.rand(2 * MIB // 4)
    slot = bytearray(b"".join(bytes(p) for p in _frame((tensor,))[0]))
    (back,) = decode(memoryview(slot))[4]
    slot[:] = b"".join(bytes(p) for p in _frame((torch.zeros(2 * MIB // 4),))[0])
    assert torch.equal(back, tensor)
    assert cache.stats()[1] >= tensor.nbytes
    (again,) = decode(memoryview(slot))[4]  # the next message in that slot
    assert again.data_ptr() != back.data_ptr()
    assert bool((again == 0).all())
    assert torch.equal(back, tensor)


def test_small_buffers_do_not_use_the_cache(cache: _buffers.BufferCache) -> None:
    parts, _ = _frame((b"s" * (MIB - 1000),))
    frame = bytearray(b"".join(bytes(p) for p in parts))
    assert decode(memoryview(frame))[4] == (b"s" * (MIB - 1000),)
    assert cache._blocks == []
    view = cache.take(cache.min_bytes - 1)
    assert isinstance(view.obj, bytearray)


def test_owned_frame_is_used_in_place(cache: _buffers.BufferCache) -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.rand(3 * MIB // 4)
    parts, nbytes = _frame((tensor,))
    whole = cache.take(nbytes)
    whole[:] = b"".join(bytes(p) for p in parts)
    (back,) = decode(pickle.PickleBuffer(whole))[4]
    del whole
    assert cache.stats()[1] > 0  # the tensor holds the block
    assert torch.equal(back, tensor)


# --- bounds and release -------------------------------------------------------------------


def test_release_unmaps_free_blocks_only(cache: _buffers.BufferCache) -> None:
    kept = cache.take(3 * MIB)
    freed = cache.take(5 * MIB)
    freed_block = cache._blocks[-1]
    del freed
    assert cache.stats() == (5 * MIB, 3 * MIB)
    assert cache.release() == 5 * MIB
    assert freed_block.map.closed
    assert cache.stats() == (0, 3 * MIB)
    kept[:4] = b"live"  # the block in use is untouched
    del kept
    assert cache.release() == 3 * MIB
    assert cache._blocks == []


def test_module_release_uses_the_process_cache(cache: _buffers.BufferCache) -> None:
    del cache  # the fixture made it the process's cache
    view = _buffers.cache.take(2 * MIB)
    del view
    assert _buffers.IdleTrim.release() == 2 * MIB


def test_free_memory_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = _buffers.BufferCache(max_idle_bytes=10 * MIB)
    views = [cache.take(n * MIB) for n in (4, 4, 4, 12)]
    del views
    cache.trim()  # the most recently used that fit the bound stay
    free, used = cache.stats()
    assert used == 0
    assert free <= 10 * MIB
    assert free == 8 * MIB  # two of 4 MiB; the 12 MiB block is bigger than the bound
    cache.release()


def test_blocks_in_use_are_tracked_up_to_a_bound() -> None:
    cache = _buffers.BufferCache(max_blocks=3)
    views = [cache.take(MIB) for _ in range(5)]
    assert len(cache._blocks) == 3  # the oldest are forgotten: their memory goes with them
    views[0][:3] = b"abc"  # still valid: a forgotten block stays mapped while it is used
    assert bytes(views[0][:3]) == b"abc"
    del views
    assert cache.release() == 3 * MIB


def test_idle_free_blocks_are_unmapped() -> None:
    cache = _buffers.BufferCache(idle_s=0.05)
    view = cache.take(2 * MIB)
    del view
    assert cache.trim() == 0  # first seen free now
    assert cache.stats()[0] == 2 * MIB
    time.sleep(0.06)
    assert cache.trim() == 2 * MIB
    assert cache._blocks == []


def test_a_block_reused_before_it_idles_is_kept() -> None:
    cache = _buffers.BufferCache(idle_s=0.05)
    for _ in range(4):
        view = cache.take(2 * MIB)
        time.sleep(0.03)  # in use longer than idle_s: not idle, in use
        del view
        cache.tick()
    assert len(cache._blocks) == 1
    cache.release()


def test_once_idle_every_free_block_goes_at_the_next_trim() -> None:
    cache = _buffers.BufferCache(idle_s=0.05)
    kept = cache.take(2 * MIB)
    time.sleep(0.06)  # no large message since: the process is idle
    del kept  # freed only now, and seen free for the first time by this trim
    assert cache.trim() == 2 * MIB
    assert cache._blocks == []


def test_idle_trim_wakes_once_after_the_last_large_message() -> None:
    cache = _buffers.BufferCache(idle_s=0.3)
    trim = _buffers.IdleTrim(cache)
    try:
        assert trim.timeout() is None  # nothing kept: sleep until the doorbell
        view = cache.take(2 * MIB)
        readable = _readable(trim.fileno())
        assert readable  # the first large message rang it
        trim.run()  # a wake for that: nothing due yet
        assert not _readable(trim.fileno())
        assert len(cache._blocks) == 1
        wait = trim.timeout()
        assert wait is not None
        assert 0.15 < wait <= 0.3  # due idle_s after the message
        cache.take(2 * MIB)  # another, dropped at once, while one is kept: no new ring
        assert not _readable(trim.fileno())
        assert len(cache._blocks) == 2
        time.sleep(0.31)
        trim.run()  # due: the dropped one goes; the one in use stays, so does the watch
        assert len(cache._blocks) == 1
        assert cache.stats() == (0, 2 * MIB)
        assert trim.timeout() is not None
        del view  # freed between two wakes: gone at the next
        wait = trim.timeout()
        assert wait is not None
        time.sleep(wait + 0.01)
        trim.run()
        assert cache._blocks == []
        assert trim.timeout() is None  # nothing kept: no timeout any more
    finally:
        trim.close()
        cache.release()
    cache.take(2 * MIB)  # a closed watch is not rung (its descriptor is closed)
    cache.release()


def _readable(fd: int) -> bool:
    import select

    return bool(select.select([fd], [], [], 0)[0])


def test_a_waiting_reader_gives_cached_memory_back(
    rings: Callable[..., Rings], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = _buffers.BufferCache(idle_s=0.05)
    monkeypatch.setattr(_buffers, "cache", cache)
    ring = rings(2, MIB)
    payload = os.urandom(3 * MIB)
    assert ring.transfer(bytes, [payload], len(payload)) == payload
    assert cache.stats()[0] > 0  # the message's block, free and cached
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(ring.readers[0].read(bytes)))
    reader.start()  # waits without a deadline for the next message
    deadline = time.monotonic() + WAIT
    while cache._blocks and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cache._blocks == []  # unmapped while the reader waited
    assert ring.writer.write([b"next"], 4, deadline=time.monotonic() + WAIT)
    reader.join(WAIT)
    assert got == [b"next"]


def test_busy_reader_trims_on_small_messages(
    rings: Callable[..., Rings], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = _buffers.BufferCache(idle_s=0.05)
    monkeypatch.setattr(_buffers, "cache", cache)
    ring = rings(2, MIB)
    payload = os.urandom(3 * MIB)
    ring.transfer(bytes, [payload], len(payload))
    deadline = time.monotonic() + WAIT
    while cache._blocks and time.monotonic() < deadline:
        assert ring.transfer(bytes, [b"small"], 5) == b"small"
        time.sleep(0.01)
    assert cache._blocks == []


def test_capacity_rounds_up_by_at_most_a_quarter() -> None:
    for nbytes in (MIB, MIB + 1, 3 * MIB - 7, 17 * MIB, 64 * MIB + 200, 129 * MIB):
        capacity = _buffer_cache._capacity(nbytes)
        assert nbytes <= capacity <= nbytes * 5 // 4 + _buffer_cache._GRANULE
    assert _buffer_cache._capacity(16 * MIB) == 16 * MIB
    assert _buffer_cache._capacity(16 * MIB + 1) == 20 * MIB


def test_interrupted_large_read_leaves_the_block_free(
    rings: Callable[..., Rings], cache: _buffers.BufferCache
) -> None:
    ring = rings(2, MIB)
    payload = b"x" * (5 * MIB)

    def interrupt() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ring.writer.write([payload], len(payload), None, interrupt)
    with pytest.raises(KeyboardInterrupt):
        ring.readers[0].read(bytes, None, interrupt)
    assert ring.readers[0].broken
    assert cache.stats()[1] == 0  # the half-read message's block went back to the cache


def test_a_block_with_a_live_view_is_never_unmapped(monkeypatch: pytest.MonkeyPatch) -> None:
    # Defence in depth: were the reference count ever misread, the mapping refuses to close
    # while exported, and the cache keeps the block as in use.
    cache = _buffers.BufferCache()
    view = cache.take(2 * MIB)
    monkeypatch.setattr(_buffer_cache, "_free", lambda block: True)
    assert cache.release() == 0
    view[:2] = b"ok"
    assert len(cache._blocks) == 1
    monkeypatch.undo()
    del view
    assert cache.release() == 2 * MIB


def test_messages_of_nearly_one_size_share_a_block() -> None:
    cache = _buffers.BufferCache()
    for nbytes in (17 * MIB, 19 * MIB + 5, 18 * MIB, 20 * MIB):
        view = cache.take(nbytes)
        assert len(view) == nbytes
        del view
    assert len(cache._blocks) == 1  # all within one quarter step: one block of 20 MiB
    assert cache.stats() == (20 * MIB, 0)
    view = cache.take(21 * MIB)  # the next step: a block of its own
    assert len(cache._blocks) == 2
    del view
    cache.release()
