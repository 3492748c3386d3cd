"""The ring's memory order (docs/memory-ordering.md): the fences chosen per CPU, counters
stored and loaded whole, every counter access going through ``_fence``, and no wake-up of a
writer waiting for a free slot missed (so it needs no naps)."""

from __future__ import annotations

import ast
import mmap
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from executor_channel import Doorbell
from executor_channel._shm import fence as _fence
from executor_channel._shm import ring as _ring
from executor_channel._shm.ring import Ring, RingLayout
from executor_channel._shm.segment import SharedSegment

WAIT = 10.0  # every wait in these tests is bounded by this


# --- the fences ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "machine", "weak"),
    [
        ("auto", "x86_64", False),
        ("auto", "aarch64", True),
        ("auto", "ppc64le", True),
        ("weak", "x86_64", True),
        ("lock", "x86_64", True),
    ],
)
def test_fences_per_cpu(mode: str, machine: str, weak: bool) -> None:
    name, is_weak, acquire, release, full = _fence._choose(mode, machine)
    assert is_weak is weak
    assert name == ("lock" if mode == "lock" else _fence.FENCE)
    for fence in (acquire, release, full):
        fence()  # callable, from any thread; returns nothing
    threads = [threading.Thread(target=lambda: [full() for _ in range(1000)]) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)


def test_unknown_mode_refused() -> None:
    with pytest.raises(ValueError, match="EXECUTOR_CHANNEL_FENCE"):
        _fence._choose("fast", "x86_64")


def test_libatomic_fence_here() -> None:
    """This machine (and CI's) has GCC's libatomic: the documented fence, not the fallback."""
    if _fence._libatomic_fence() is None:
        pytest.skip("libatomic.so.1 is not installed here (the lock fence is used)")
    assert _fence.FENCE == "libatomic" or os.environ.get(_fence.ENV) == "lock"


@pytest.fixture
def page() -> Iterator[memoryview]:
    mapping = mmap.mmap(-1, 4096)
    view = memoryview(mapping)
    yield view
    view.release()
    mapping.close()


@pytest.mark.parametrize(
    ("load", "store"),
    [
        (_fence.load_acquire, _fence.store_release),
        (_fence._load_fenced, _fence._store_fenced),
        (_fence._U64.unpack_from, _fence._store_plain),
    ],
)
def test_load_store_round_trip(page: memoryview, load: object, store: object) -> None:
    assert callable(load)
    assert callable(store)
    for value in (0, 1, 255, 256, 2**32, 2**64 - 1):
        store(page, 64, value)
        assert load(page, 64) == (value,)
    assert bytes(page[56:64]) == bytes(8)  # the 8 bytes only
    assert bytes(page[72:80]) == bytes(8)


@pytest.mark.parametrize(
    "store_fence_load",
    [_fence.store_fence_load, _fence._store_fence_load_plain, _fence._store_fence_load_fenced],
)
def test_store_fence_load(page: memoryview, store_fence_load: object) -> None:
    assert callable(store_fence_load)
    _fence.store_release(page, 8, 1)
    assert store_fence_load(page, 64, 5, 8) == 1
    assert _fence.load(page, 64) == (5,)
    _fence.store_release(page, 8, 0)
    assert store_fence_load(page, 64, 6, 8) == 0
    assert _fence.load(page, 64) == (6,)


def test_segment_closes_after_counter_access() -> None:
    """Counter accesses leave no view of the mapping behind: it is unmapped at close."""
    segment = SharedSegment.create(4096)
    _fence.store_release(segment.buf, 0, 7)
    assert _fence.load_acquire(segment.buf, 0) == (7,)
    segment.close()
    assert segment._mmap is None
    with pytest.raises(ValueError):
        _fence.load_acquire(segment.buf, 0)


_MONOTONIC_READER = textwrap.dedent(
    """
    import mmap, sys
    from executor_channel._shm import fence as _fence
    fd, n = int(sys.argv[1]), int(sys.argv[2])
    buf = memoryview(mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED))
    last = reads = 0
    print("ready", flush=True)
    while last < n:
        value = _fence.load_acquire(buf, 0)[0]
        reads += 1
        if value < last:
            sys.exit(f"counter went from {last} to {value}")
        last = value
    print(reads, flush=True)
    """
)


@pytest.mark.slow
def test_counter_never_seen_going_back() -> None:
    """A counter stored by one process and loaded by another only ever grows: each store is
    one 8-byte write (``struct.pack_into`` zero-fills first: a reader saw 0 thousands of
    times in a run like this one)."""
    n = 2_000_000
    segment = SharedSegment.create(4096)
    try:
        reader = subprocess.Popen(
            [sys.executable, "-c", _MONOTONIC_READER, str(segment.fd), str(n)],
            pass_fds=(segment.fd,),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert reader.stdout is not None
        assert reader.stdout.readline() == "ready\n"
        for value in range(1, n + 1):
            _fence.store_release(segment.buf, 0, value)
            if value % 64 == 0:
                os.sched_yield()  # let the reader run on a machine with few cores
        out, err = reader.communicate(timeout=60)
        assert reader.returncode == 0, err
        assert int(out) > 10_000  # it read while the values were stored
    finally:
        segment.close()


def test_ring_counters_only_through_fence() -> None:
    """The ring's module (``_ring.py``) has no 8-byte accessor of its own (its one struct is
    the slot header), and outside ``__init__`` every counter offset (or a local name given
    one) is used only as an argument of ``_fence``'s loads and stores."""
    paths = [Path(_ring.__file__)]
    body = [node for path in paths for node in ast.parse(path.read_text()).body]
    tree = ast.Module(body=body, type_ignores=[])
    structs = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "Struct"
    ]
    assert len(structs) == 1  # CHUNK
    counters = {"_written_off", "_waiting_off", "_own_off", "_consumed_offs"}
    accessors = {"load", "load_acquire", "store_release", "store_fence_load"}
    stray: list[str] = []
    checked = 0
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef) or func.name == "__init__":
            continue
        parents = {child: node for node in ast.walk(func) for child in ast.iter_child_nodes(node)}

        def in_accessor(node: ast.AST, parents: dict[ast.AST, ast.AST] = parents) -> bool:
            while node in parents:
                node = parents[node]
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") in accessors:
                    return True
            return False

        aliases: set[str] = set()
        uses: list[ast.AST] = []
        for node in ast.walk(func):
            if isinstance(node, ast.Attribute) and node.attr in counters:
                parent = parents[node]
                if isinstance(parent, ast.Assign | ast.For):  # off = self._written_off
                    targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
                    aliases.update(t.id for t in targets if isinstance(t, ast.Name))
                else:
                    uses.append(node)
        for node in ast.walk(func):
            if isinstance(node, ast.Name) and node.id in aliases and isinstance(node.ctx, ast.Load):
                uses.append(node)
        for node in uses:
            checked += 1
            if not in_accessor(node):
                stray.append(f"{func.name}, line {getattr(node, 'lineno', '?')}")
    assert checked >= 10
    assert not stray, stray


# --- no missed wake-up --------------------------------------------------------------------


class OneSlot:
    """A writer and one reader on a ring of one slot, the slot already full."""

    def __init__(self) -> None:
        layout = RingLayout(0, 1, 1, 4096)
        self.segment = SharedSegment.create(layout.nbytes)
        data, space = Doorbell(), Doorbell()
        self.writer = Ring(
            self.segment.buf, layout, reader=None, data_bells=[data], space_bell=space
        )
        self.reader = Ring(self.segment.buf, layout, reader=0, data_bells=[data], space_bell=space)
        assert self.writer.write([b"first"], 5)
        assert not self.writer.write([b"second"], 6, deadline=time.monotonic())  # full

    def read_after(self, delay: float) -> threading.Thread:
        def read() -> None:
            time.sleep(delay)
            self.reader.read(bytes, deadline=time.monotonic() + WAIT)

        thread = threading.Thread(target=read)
        thread.start()
        return thread

    def close(self) -> None:
        self.segment.close()


@pytest.fixture
def one_slot() -> Iterator[OneSlot]:
    ring = OneSlot()
    yield ring
    ring.close()


def test_blocked_writer_woken_by_release(
    one_slot: OneSlot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer without a callback sleeps until the reader's release rings: with its
    re-check pushed out to 30 s, a missed ring would show as a 30 s wait."""
    monkeypatch.setattr(_ring, "MAX_SLEEP_S", 30.0)
    start = time.monotonic()
    thread = one_slot.read_after(0.05)
    assert one_slot.writer.write([b"second"], 6)
    took = time.monotonic() - start
    thread.join(WAIT)
    assert 0.05 <= took < 5.0, f"woken after {took:.3f} s"
    received: list[bytes] = []
    assert one_slot.reader.read(lambda view: received.append(bytes(view)), WAIT) is None
    assert received == [b"second"]


def test_blocked_writer_runs_its_callback(one_slot: OneSlot) -> None:
    """A writer with a callback (the driver reads replies in it) also wakes to run it."""
    calls: list[float] = []
    thread = one_slot.read_after(0.2)
    assert one_slot.writer.write([b"second"], 6, None, lambda: calls.append(time.monotonic()))
    thread.join(WAIT)
    assert len(calls) >= 5  # at 0.5, 1, 2, 4, 8, ... ms, then every 50 ms
