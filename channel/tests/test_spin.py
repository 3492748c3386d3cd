"""The spin budget: bounded spinning that stops when yielding loses the CPU."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from executor_channel import ChannelTransport
from executor_channel._shm import spin as _spin
from executor_channel._shm.spin import Spinner


def test_zero_spin_never_spins() -> None:
    assert Spinner(0.0).start() == 0.0


def test_spin_window_starts_now() -> None:
    before = time.monotonic()
    until = Spinner(0.001).start()
    assert before + 0.001 <= until <= time.monotonic() + 0.001


def test_quick_yield_keeps_spinning(monkeypatch: pytest.MonkeyPatch) -> None:
    # A yield that gets the CPU straight back (no other process wanted it).
    monkeypatch.setattr(os, "sched_yield", lambda: None)
    spinner = Spinner(0.001)
    assert spinner.pause()
    assert spinner.start() > 0.0


def test_a_delayed_answer_stops_spinning_for_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    # A yield that returns a time slice later (another busy process ran) is simulated by
    # sleeping past the threshold. It ends the wait's spin, but only an answer that came
    # meanwhile (reported with contended()) quiets the process's waits.
    monkeypatch.setattr(os, "sched_yield", lambda: time.sleep(2 * _spin.LOST_CPU_S))
    spinner = Spinner(0.001)
    assert spinner.start() > 0.0
    assert not spinner.pause()
    assert spinner.start() > 0.0  # a loss alone cost nothing
    spinner.contended()
    assert spinner.start() == 0.0  # quiet: waits sleep at once
    time.sleep(_spin.QUIET_MIN_S)
    assert spinner.start() > 0.0  # spinning again once the quiet time is over


def test_quiet_time_grows_while_delays_continue(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_spin, "QUIET_MIN_S", 0.02)
    monkeypatch.setattr(_spin, "QUIET_MAX_S", 0.08)
    spinner = Spinner(0.001)
    quiet = []
    for _ in range(4):  # each delay right after the previous quiet time
        spinner.contended()
        quiet.append(spinner._quiet_s)
        time.sleep(max(0.0, spinner._quiet_until - time.monotonic()))
    assert quiet == [0.02, 0.04, 0.08, 0.08]
    time.sleep(0.2)  # calm for longer than the quiet time: back to the shortest
    spinner.contended()
    assert spinner._quiet_s == 0.02


def test_delays_during_large_transfers_do_not_count() -> None:
    spinner = Spinner(0.001)
    spinner.bulk = True  # the last message this process moved spanned several slots
    spinner.contended()
    assert spinner.start() > 0.0
    spinner.bulk = False
    spinner.contended()
    assert spinner.start() == 0.0


def test_a_wait_may_ask_for_its_own_budget_under_the_same_back_off() -> None:
    spinner = Spinner(0.001)
    before = time.monotonic()
    until = spinner.start(0.005)  # a worker waiting for its next call (idle_spin_s)
    assert before + 0.005 <= until <= time.monotonic() + 0.005
    assert spinner.start(0.0) == 0.0
    # Contention seen by any wait quiets them all, whatever their budget.
    spinner.contended()
    assert spinner.start(0.005) == 0.0


def lose_next_yield(monkeypatch: pytest.MonkeyPatch, meanwhile: Callable[[], None] | None) -> None:
    """Make the next ``sched_yield`` lose the CPU (return after the threshold), running
    ``meanwhile`` first: what another process does while this one is off the CPU."""

    def slow_yield() -> None:
        monkeypatch.setattr(os, "sched_yield", lambda: None)  # only this yield is lost
        if meanwhile is not None:
            meanwhile()
        time.sleep(2 * _spin.LOST_CPU_S)

    monkeypatch.setattr(os, "sched_yield", slow_yield)


@contextlib.contextmanager
def node_rings(spin_s: float, worker_spin_s: float = 0.0) -> Iterator[tuple[Any, Any]]:
    """A driver's rings for one worker (4 slots of 4 KiB each way) and that worker's end."""
    from executor_channel import NodeRings, WorkerRings
    from executor_channel._shm.node_rings import RingSizes

    sizes = RingSizes(slots=4, slot_bytes=4096, reply_slots=4, reply_slot_bytes=4096, spin_s=spin_s)
    cleanups: list[Callable[[], None]] = []
    try:
        rings = NodeRings(1, sizes, cleanups.append)
        worker = WorkerRings.attach(rings.worker_fds(0), rings.layout, 0, worker_spin_s, 0.0)
        try:
            yield rings, worker
        finally:
            worker.segment.close()
    finally:
        for cleanup in reversed(cleanups):
            cleanup()


class _Pair:
    """A writer and one reader on a ring of 4 slots of 4 KiB; the reader has ``spinner``.
    ``lose_cpu`` makes the reader's next yield lose the CPU, ``arrive`` being written into
    the ring meanwhile (None: nothing)."""

    def __init__(self, spinner: Spinner, *, ends_bulk: bool = True) -> None:
        from executor_channel import Doorbell
        from executor_channel._shm.ring import Ring, RingLayout
        from executor_channel._shm.segment import SharedSegment

        layout = RingLayout(0, 1, 4, 4096)
        self.segment = SharedSegment.create(layout.nbytes)
        data, space = Doorbell(), Doorbell()
        buf = self.segment.buf
        self.writer = Ring(buf, layout, reader=None, data_bells=[data], space_bell=space)
        self.reader = Ring(
            buf,
            layout,
            reader=0,
            data_bells=[data],
            space_bell=space,
            spin=spinner,
            ends_bulk=ends_bulk,
        )

    def send(self, nbytes: int) -> None:
        assert self.writer.write([bytes(nbytes)], nbytes, time.monotonic() + 5.0)

    def lose_cpu(self, monkeypatch: pytest.MonkeyPatch, arrive: int | None) -> None:
        lose_next_yield(monkeypatch, None if arrive is None else lambda: self.send(arrive))

    def read(self) -> int:
        got = self.reader.read(lambda data: len(memoryview(data)), time.monotonic() + 5.0)
        assert got is not None
        return got

    def close(self) -> None:
        self.segment.close()


def test_a_small_message_delayed_by_a_lost_yield_quiets_the_reader(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spinner = Spinner(0.01)
    pair = _Pair(spinner)
    try:
        pair.lose_cpu(monkeypatch, arrive=100)
        assert pair.read() == 100
        assert spinner.start() == 0.0  # quiet
    finally:
        pair.close()


def test_a_large_message_or_none_arriving_during_a_lost_yield_does_not_quiet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spinner = Spinner(0.01)
    pair = _Pair(spinner)
    try:
        # The first chunk of a message of three slots arrives while the reader is off the CPU.
        pair.lose_cpu(monkeypatch, arrive=10_000)
        assert pair.read() == 10_000
        assert spinner.start() > 0.0
        assert spinner.bulk
        # Nothing arrives during the lost yield: the reader sleeps until the message comes.
        pair.lose_cpu(monkeypatch, arrive=None)
        timer = threading.Timer(0.05, pair.send, (100,))
        timer.start()
        assert pair.read() == 100
        timer.join()
        assert spinner.start() > 0.0
        assert not spinner.bulk  # a small message on a ring of calls ends the bulk state
    finally:
        pair.close()


def test_a_small_reply_to_a_large_call_does_not_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    # A reply ring (ends_bulk=False): its small messages can answer a large call that the
    # other ranks are still copying, so they leave the bulk state as it is.
    spinner = Spinner(0.01)
    pair = _Pair(spinner, ends_bulk=False)
    try:
        spinner.bulk = True  # this process just wrote a large call
        pair.lose_cpu(monkeypatch, arrive=100)
        assert pair.read() == 100
        assert spinner.start() > 0.0
        assert spinner.bulk
    finally:
        pair.close()


def test_small_waiting_tells_a_short_answer_from_a_large_transfer() -> None:
    pair = _Pair(Spinner(0.0))
    try:
        assert not pair.reader.small_waiting()
        pair.send(100)
        assert pair.reader.small_waiting()
        assert pair.read() == 100
        pair.send(10_000)
        assert not pair.reader.small_waiting()
        assert pair.read() == 10_000
    finally:
        pair.close()


def test_a_worker_waits_for_calls_with_the_longer_of_its_budgets() -> None:
    from executor_channel import NodeRings, WorkerRings
    from executor_channel._shm.node_rings import RingSizes

    sizes = RingSizes(slots=2, slot_bytes=4096, reply_slots=1, reply_slot_bytes=4096, spin_s=0)
    for spin_s, idle_spin_s, expected in ((1e-4, 0.005, 0.005), (1e-4, 0.0, 1e-4)):
        cleanups: list[Callable[[], None]] = []
        rings = NodeRings(1, sizes, cleanups.append)
        try:
            worker = WorkerRings.attach(rings.worker_fds(0), rings.layout, 0, spin_s, idle_spin_s)
            # idle_spin_s 0 means "only spin_s", never "no spin at all".
            assert worker.calls._wait_spin_s == expected
            worker.segment.close()
        finally:
            for cleanup in reversed(cleanups):
                cleanup()


@pytest.mark.parametrize(
    ("bulk", "size", "quiet"),
    [(False, 10, True), (True, 10, False), (False, 10_000, False)],
    ids=["small reply to a small call", "small reply to a large call", "large reply"],
)
def test_the_driver_counts_only_a_small_reply_that_came_during_a_lost_yield(
    monkeypatch: pytest.MonkeyPatch, bulk: bool, size: int, quiet: bool
) -> None:
    from types import SimpleNamespace

    from executor_channel._codec import KIND_REPLY, encode

    with node_rings(0.01) as (rings, worker):
        delivered: list[tuple[int, int, bool, object]] = []
        host = SimpleNamespace(deliver=lambda *reply: delivered.append(reply))
        driver = _Channel(host)  # type: ignore[arg-type]  # only deliver is used
        driver.attach_channel(rings)

        def reply() -> None:
            parts, nbytes = encode(KIND_REPLY, True, 0, 7, bytes(size))
            assert worker.replies.write(parts, nbytes, time.monotonic() + 5.0)

        rings.spinner.bulk = bulk  # as the driver's last call left it
        lose_next_yield(monkeypatch, reply)
        driver.poll(5.0)
        assert [(seq, rank, ok, len(value)) for seq, rank, ok, value in delivered] == [
            (7, 0, True, size)
        ]
        assert (rings.spinner.start() == 0.0) is quiet


class _Channel(ChannelTransport):
    """The channel's transport with nothing to start or stop (the rings are the test's)."""

    def start(self) -> None:
        pass

    def close(self, graceful: bool) -> None:
        pass
