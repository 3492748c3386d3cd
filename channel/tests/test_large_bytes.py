"""Large ``bytes`` arguments and results: a message of several slots is assembled with each large
``bytes`` copied once, straight into the object it becomes, and a large ``bytes`` is made from
heap memory that stays warm between messages until the process goes idle (glibc)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from executor_channel import Doorbell, Received, encode
from executor_channel._codec import (
    OOB_BYTES_THRESHOLD,
    STREAM_CHUNK,
    copied_whole,
    decode,
    plan_assembly,
)
from executor_channel._memory import buffers as _buffers
from executor_channel._memory import heap as _heap
from executor_channel._shm.ring import Ring, RingLayout
from executor_channel._shm.segment import SharedSegment

MIB = 1 << 20
WAIT = 10.0  # every wait in these tests is bounded by this
GLIBC = sys.platform == "linux" and os.confstr("CS_GNU_LIBC_VERSION") is not None


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[_buffers.BufferCache]:
    """A cache of this test's own, recording the ``bytes`` objects it makes."""
    fresh = _buffers.BufferCache()
    made: list[bytes] = []
    new_bytes = fresh.new_bytes

    def recording(nbytes: int) -> tuple[bytes, memoryview] | None:
        result = new_bytes(nbytes)
        if result is not None:
            made.append(result[0])
        return result

    monkeypatch.setattr(fresh, "new_bytes", recording)
    fresh.made = made  # type: ignore[attr-defined]
    monkeypatch.setattr(_buffers, "cache", fresh)
    yield fresh
    fresh.release()


@pytest.fixture
def ring() -> Iterator[tuple[Ring, Ring]]:
    """A writer and one reader on a ring of 2 slots of 1 MiB."""
    layout = RingLayout(0, 1, 2, MIB)
    segment = SharedSegment.create(layout.nbytes)
    data, space = Doorbell(), Doorbell()
    writer = Ring(segment.buf, layout, reader=None, data_bells=[data], space_bell=space)
    reader = Ring(segment.buf, layout, reader=0, data_bells=[data], space_bell=space)
    yield writer, reader
    del writer, reader
    segment.close()


def _body(view: Received) -> Any:
    return decode(view)[4]


def _transfer(ring: tuple[Ring, Ring], value: Any, assemble: bool = True) -> Any:
    writer, reader = ring
    parts, nbytes = encode(4, True, 0, 1, value)
    thread = threading.Thread(
        target=writer.write, args=(parts, nbytes), kwargs={"deadline": time.monotonic() + WAIT}
    )
    thread.start()
    try:
        return reader.read(
            _body, deadline=time.monotonic() + WAIT, assemble=plan_assembly if assemble else None
        )
    finally:
        thread.join(WAIT)
        assert not thread.is_alive()


def test_large_bytes_of_several_slots_go_straight_into_their_object(
    cache: _buffers.BufferCache, ring: tuple[Ring, Ring]
) -> None:
    payload = os.urandom(5 * MIB + 123)
    received = _transfer(ring, payload)
    assert type(received) is bytes
    assert received == payload
    # The object the reader filled from the ring is the one handed over: no second copy.
    assert [id(made) for made in cache.made] == [id(received)]  # type: ignore[attr-defined]


def test_assembled_message_keeps_every_kind_of_value(
    cache: _buffers.BufferCache, ring: tuple[Ring, Ring]
) -> None:
    numpy = pytest.importorskip("numpy")
    big = os.urandom(3 * MIB)
    array = numpy.arange(400_000, dtype=numpy.float64)  # 3.2 MB, from the cache
    value = {"big": big, "small": b"s" * 5000, "array": array, "tail": [b"t" * 2 * MIB, 7]}
    received = _transfer(ring, value)
    assert received["big"] == big
    assert type(received["big"]) is bytes
    assert received["small"] == value["small"]
    assert received["tail"] == value["tail"]
    numpy.testing.assert_array_equal(received["array"], array)
    assert len(cache.made) == 2  # type: ignore[attr-defined]  # the two large bytes only
    # Later messages through the same slots leave what was received intact.
    for _ in range(3):
        _transfer(ring, os.urandom(4 * MIB))
    assert received["big"] == big
    numpy.testing.assert_array_equal(received["array"], array)


def test_messages_without_large_bytes_are_copied_as_one_block(
    cache: _buffers.BufferCache, ring: tuple[Ring, Ring]
) -> None:
    numpy = pytest.importorskip("numpy")
    array = numpy.ones(600_000, dtype=numpy.float32)
    received = _transfer(ring, array)
    numpy.testing.assert_array_equal(received, array)
    assert cache.made == []  # type: ignore[attr-defined]


def test_plan_refuses_frames_it_cannot_place() -> None:
    # Not a frame of the codec: random bytes, a header whose lengths do not add up, a
    # first chunk too short for its lengths.
    assert plan_assembly(memoryview(os.urandom(4096)), 8 * MIB) is None
    parts, nbytes = encode(4, True, 0, 1, b"x" * (2 * MIB))
    head = b"".join(bytes(part) for part in parts[:2])
    assert plan_assembly(memoryview(head), nbytes + 1) is None
    assert plan_assembly(memoryview(head[:20]), nbytes) is None
    plan = plan_assembly(memoryview(head), nbytes)
    assert plan is not None
    assert sum(len(dest) for dest in plan[0]) == nbytes


def test_a_frame_read_without_assemble_is_still_one_owned_block(
    cache: _buffers.BufferCache, ring: tuple[Ring, Ring]
) -> None:
    payload = os.urandom(3 * MIB)
    writer, reader = ring
    parts, nbytes = encode(4, True, 0, 1, payload)
    thread = threading.Thread(
        target=writer.write, args=(parts, nbytes), kwargs={"deadline": time.monotonic() + WAIT}
    )
    thread.start()
    frame = reader.read(lambda view: view, deadline=time.monotonic() + WAIT)
    thread.join(WAIT)
    assert isinstance(frame, pickle.PickleBuffer)
    assert decode(frame)[4] == payload


@pytest.mark.skipif(not GLIBC, reason="the warm heap is glibc's")
def test_large_bytes_reuse_warm_heap_memory_until_released() -> None:
    """In a process of its own (the heap settings are process-wide): the second large
    ``bytes`` takes few page faults, and release gives the memory back to the kernel."""
    script = textwrap.dedent(
        """
        import resource
        from executor_channel._memory import buffers as _buffers
        from executor_channel._memory import heap as _heap

        MIB = 1 << 20
        source = bytearray(48 * MIB)
        source[::4096] = b"x" * len(source[::4096])

        def faults_for_one():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            data = _buffers.cache.take_bytes(memoryview(source))
            assert data == source
            del data
            return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

        def resident_mib():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * 4096 // MIB

        first, second = faults_for_one(), faults_for_one()
        kept = resident_mib()
        assert _buffers.cache.trim_wait_s() == _buffers.IDLE_S  # armed for the idle trim
        _buffers.IdleTrim.release()
        print(_heap.enabled(), first, second, kept - resident_mib(), _buffers.cache.trim_wait_s())
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    enabled, first, second, returned, wait = result.stdout.split()
    assert enabled == "True"
    pages = 48 * MIB // 4096
    assert int(first) > pages // 2  # fresh memory the first time
    assert int(second) < pages // 10  # warm heap memory the second time
    assert int(returned) >= 40  # given back on release
    assert wait == "None"


@pytest.mark.skipif(not GLIBC, reason="the warm heap is glibc's")
def test_a_large_bytes_freed_after_the_idle_trim_still_goes_back() -> None:
    """In a process of its own: the cache holds each large ``bytes`` it made, so one still
    referenced at the idle trim and freed later is let go and trimmed at the next trim, not
    kept in the heap until another large message comes."""
    script = textwrap.dedent(
        """
        import time
        from executor_channel._memory import buffers as _buffers

        MIB = 1 << 20
        cache = _buffers.BufferCache(idle_s=0.1)
        source = bytearray(100 * MIB)

        def resident_mib():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * 4096 // MIB

        base = resident_mib()
        data = [cache.take_bytes(memoryview(source)) for _ in range(2)]
        time.sleep(0.15)
        cache.trim()  # idle: the heap is trimmed, but both are still referenced
        held, kept = len(cache._held), resident_mib() - base
        waits = [cache.trim_wait_s()]
        del data  # freed by the caller only now
        waits.append(cache.trim_wait_s())  # something to give back again
        cache.trim()
        print(held, kept, resident_mib() - base, len(cache._held), *waits)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    held, kept, left, held_after, wait_in_use, wait_freed = result.stdout.split()
    assert held == "2"
    assert int(kept) >= 190  # both in use: resident
    assert wait_in_use == "None"  # nothing free: a waiting reader needs no timeout
    assert wait_freed == "0.1"
    assert held_after == "0"
    assert int(left) < 20  # let go and trimmed: back to the kernel


def test_small_and_huge_bytes_take_the_plain_path() -> None:
    assert _heap.allocate_bytes(b"abc", 256 * MIB) == b"abc"
    made = _heap.new_bytes(10, 256 * MIB)
    assert made is not None
    data, view = made
    view[:] = b"0123456789"
    assert data == b"0123456789"
    assert _heap.new_bytes(0, 256 * MIB) is None


def test_calls_whose_readers_copy_every_byte_may_be_streamed() -> None:
    # copied_whole: no out-of-band buffer of the frame is built on in place by a worker.
    big = STREAM_CHUNK + 1

    def copied(body: Any) -> bool:
        parts, nbytes = encode(1, True, -1, 1, body)
        return copied_whole(parts[0], nbytes)

    assert copied(("m", (b"x" * big,), {}))  # bytes: copied into their own object
    assert copied(("m", (b"x" * big, b"y" * (OOB_BYTES_THRESHOLD + 1)), {}))
    assert copied(("m", ([0.5] * (big // 8),), {}))  # all in the pickle: rebuilt anew
    assert not copied(("m", (b"x" * (STREAM_CHUNK - 4096),), {}))  # one chunk, with its header
    # A first piece too short for the header or its lengths (a call that came over the
    # network in small chunks): not known to be copied, so not streamed.
    parts, nbytes = encode(1, True, -1, 1, ("m", (b"x" * big,), {}))
    head = bytes(parts[0])
    assert copied_whole(head, nbytes)
    assert not copied_whole(head[:10], nbytes)
    assert not copied_whole(head[: len(head) - 1], nbytes)
    numpy = pytest.importorskip("numpy")
    assert not copied(("m", (numpy.zeros(big, dtype=numpy.uint8),), {}))  # built in place
    assert not copied(("m", (b"x" * big, numpy.zeros(8)), {}))  # one array is enough
