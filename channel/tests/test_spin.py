"""The spin budget: bounded spinning that stops when yielding loses the CPU."""

from __future__ import annotations

import os
import time

import pytest

from executor_channel import _spin
from executor_channel.shm import Spinner


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


def test_lost_cpu_stops_spinning_for_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    # A yield that returns a time slice later (another busy process ran) is simulated by
    # sleeping past the threshold.
    monkeypatch.setattr(os, "sched_yield", lambda: time.sleep(2 * _spin.LOST_CPU_S))
    spinner = Spinner(0.001)
    assert spinner.start() > 0.0
    assert not spinner.pause()
    assert spinner.start() == 0.0  # quiet: waits sleep at once
    time.sleep(_spin.QUIET_MIN_S)
    assert spinner.start() > 0.0  # spinning again once the quiet time is over


def test_quiet_time_grows_while_losses_continue(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_yield", lambda: time.sleep(2 * _spin.LOST_CPU_S))
    monkeypatch.setattr(_spin, "QUIET_MIN_S", 0.02)
    monkeypatch.setattr(_spin, "QUIET_MAX_S", 0.08)
    spinner = Spinner(0.001)
    quiet = []
    for _ in range(4):  # each loss right after the previous quiet time
        assert not spinner.pause()
        quiet.append(spinner._quiet_s)
        time.sleep(max(0.0, spinner._quiet_until - time.monotonic()))
    assert quiet == [0.02, 0.04, 0.08, 0.08]
    time.sleep(0.2)  # calm for longer than the quiet time: back to the shortest
    assert not spinner.pause()
    assert spinner._quiet_s == 0.02


def test_a_wait_may_ask_for_its_own_budget_under_the_same_back_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spinner = Spinner(0.001)
    before = time.monotonic()
    until = spinner.start(0.005)  # a worker waiting for its next call (idle_spin_s)
    assert before + 0.005 <= until <= time.monotonic() + 0.005
    assert spinner.start(0.0) == 0.0
    # Contention seen by any wait quiets them all, whatever their budget.
    monkeypatch.setattr(os, "sched_yield", lambda: time.sleep(2 * _spin.LOST_CPU_S))
    assert not spinner.pause()
    assert spinner.start(0.005) == 0.0


def test_a_worker_waits_for_calls_with_the_longer_of_its_budgets() -> None:
    from collections.abc import Callable

    from executor_channel.shm import NodeRings, RingSizes, WorkerRings

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
