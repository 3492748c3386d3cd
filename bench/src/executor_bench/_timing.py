"""The timing loop: a phase's sides measured row by row in interleaved rounds, then their
start-up one side at a time; a side that fails is taken out, the others go on.

The calls (no-op back to back, no-op after idle, payloads) are measured with every side of a
phase started at once, in rounds: in each round every side runs every row, the sides in a
rotating order, so that the machine's noise (other processes, frequency changes) falls on all
of them alike. A side whose workers busy-wait after a call (vLLM's readers) is followed by a
pause long enough for them to stop, so that it never takes a core from the side timed after
it. Then the phase's sides are stopped, and start-up is measured one side at a time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from ._sides import Side, SideSpec, Skipped
from ._workloads import Plan, Row

__all__ = ["TimingLoop", "describe"]

#: Seconds to wait after a busy-waiting side's block: vLLM's readers spin for 1 s after
#: their last read before they block, and two spinning readers fill a small machine.
SETTLE_S = 1.2


class _SideFailed(Exception):
    pass


def _check(side: SideSpec, row: Row, result: list[Any]) -> None:
    expected = [row.size] * side.workers
    if result != expected:
        raise _SideFailed(f"{row.key}: returned {result!r:.200}, expected {expected!r:.200}")


def _is_unavailable(exc: BaseException) -> bool:
    """An error saying the side cannot run here (not installed, not configured for it)."""
    from executor_core import BackendLoadError, ConfigError, UnknownBackendError

    return isinstance(exc, BackendLoadError | ConfigError | UnknownBackendError | ImportError)


def describe(what: str, exc: BaseException) -> str:
    """Why a side or workload is out of the run: ``what``, and the error's first line."""
    lines = str(exc).strip().splitlines()
    return f"{what}: {type(exc).__name__}" + (f": {lines[0]}" if lines else "")


class TimingLoop:
    """The timing loop's state and steps, for :class:`~executor_bench._run.Bench`, which
    sets :attr:`plan`, :attr:`sides` and (while it measures) :attr:`bar`."""

    plan: Plan
    sides: list[SideSpec]
    #: The progress bar (tqdm) while the sides are measured.
    bar: Any

    def __init__(self) -> None:
        self.skipped: list[Skipped] = []
        self.failed: list[Skipped] = []
        self.samples: dict[tuple[str, str], list[float]] = {}
        #: (row key, side name) -> calls in each round, in order: the rounds of ``samples``.
        self.round_calls: dict[tuple[str, str], list[int]] = {}
        self.live: dict[str, Side] = {}
        self.payloads: dict[str, Any] = {}
        #: Sides taken out of the run (skipped or failed).
        self.out: set[str] = set()

    # --- a phase ---------------------------------------------------------------------------

    def _calls(self, sides: list[SideSpec], rows: list[Row]) -> None:
        """Start ``sides``, warm them up, measure ``rows`` in interleaved rounds, stop them."""
        for side in sides:
            self.bar.set_description(f"starting {side.name}")
            try:
                self.live[side.name] = side.start()
            except Exception as exc:  # noqa: BLE001  (reported with the side, the run goes on)
                self._lost(side, "could not start", exc)
            self.bar.update()
        for side in self._live_sides():
            self.bar.set_description(f"warming up {side.name}")
            self._guarded(side, self._warm_up, rows)
            self.bar.update()
        for turn in range(self.plan.rounds):
            order = self._live_sides()
            shift = turn % len(order) if order else 0
            for side in order[shift:] + order[:shift]:
                self.bar.set_description(f"round {turn + 1}/{self.plan.rounds}: {side.name}")
                self._guarded(side, self._block, rows)
                self.bar.update()
        self._close_all()

    def _startup(self, sides: list[SideSpec]) -> None:
        """Start and stop each of ``sides`` in turn, ``startup_samples`` times."""
        sides = [s for s in sides if s.name not in self.out]
        samples = self.plan.startup_samples
        for turn in range(samples):
            shift = turn % len(sides) if sides else 0
            for side in sides[shift:] + sides[:shift]:
                if side.name in self.out or "startup" not in side.workloads:
                    self.bar.update()
                    continue
                self.bar.set_description(f"start-up {turn + 1}/{samples}: {side.name}")
                began = time.perf_counter()
                try:
                    started = side.start()
                except Exception as exc:  # noqa: BLE001  (reported with the side)
                    self._lost(side, "could not start", exc)
                    self.bar.update()
                    continue
                self.live[side.name] = started
                ready = -1.0
                try:
                    result = started.call("noop", ())
                    ready = time.perf_counter()
                    _check(side, Row("startup"), result)
                    del self.live[side.name]
                    started.close()
                    stopped = time.perf_counter()
                except Exception as exc:  # noqa: BLE001  (reported with the side)
                    self._lost(side, "failed in start-up", exc)
                else:
                    self.samples.setdefault(("startup", side.name), []).append(ready - began)
                    self.samples.setdefault(("shutdown", side.name), []).append(stopped - ready)
                self.bar.update()

    # --- one side --------------------------------------------------------------------------

    def _warm_up(self, side: SideSpec, rows: list[Row]) -> None:
        live = self.live[side.name]
        for row in rows:
            if row.workload not in side.workloads:
                continue
            args = self._args(row)
            for _ in range(self.plan.warmup_calls(row)):
                _check(side, row, live.call(row.method, args))
        self._settle(side)

    def _block(self, side: SideSpec, rows: list[Row]) -> None:
        live = self.live[side.name]
        clock = time.perf_counter
        for row in rows:
            if row.workload not in side.workloads:
                continue
            args = self._args(row)
            method = row.method
            cold = row.workload == "cold"
            out = self.samples.setdefault((row.key, side.name), [])
            if not cold:  # untimed: the first call after another row wakes the side up
                _check(side, row, live.call(method, args))
            calls = self.plan.calls(row)
            for _ in range(calls):
                if cold:
                    time.sleep(self.plan.idle_s)
                start = clock()
                result = live.call(method, args)
                out.append(clock() - start)
                _check(side, row, result)
            self.round_calls.setdefault((row.key, side.name), []).append(calls)
        self._settle(side)

    def _args(self, row: Row) -> tuple[Any, ...]:
        return () if row.size is None else (self.payloads[row.key],)

    def _settle(self, side: SideSpec) -> None:
        if side.spins:
            self.bar.set_description(f"letting {side.name} settle")
            time.sleep(SETTLE_S)

    def _guarded(
        self, side: SideSpec, step: Callable[[SideSpec, list[Row]], None], rows: list[Row]
    ) -> None:
        if side.name not in self.live:
            return
        try:
            step(side, rows)
        except Exception as exc:  # noqa: BLE001  (reported with the side, the run goes on)
            self._lost(side, "failed", exc)

    def _live_sides(self) -> list[SideSpec]:
        return [side for side in self.sides if side.name in self.live]

    def _lost(self, side: SideSpec, what: str, exc: BaseException) -> None:
        """Take ``side`` out of the run: skipped if it cannot run here, failed otherwise."""
        live = self.live.pop(side.name, None)
        if live is not None:
            with contextlib.suppress(Exception):
                live.close()
        entry = Skipped(side.name, side.role, describe(what, exc))
        if what == "could not start" and _is_unavailable(exc):
            self.skipped.append(entry)
        else:
            self.failed.append(entry)
        self.out.add(side.name)

    def _close_all(self) -> None:
        while self.live:
            name, live = self.live.popitem()
            self.bar.set_description(f"stopping {name}")
            with contextlib.suppress(Exception):
                live.close()
