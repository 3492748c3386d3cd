"""One benchmark run: select the sides, measure them interleaved, return every sample.

The calls (no-op back to back, no-op after idle, payloads) are measured with every side of a
phase started at once, in rounds: in each round every side runs every row, the sides in a
rotating order, so that the machine's noise (other processes, frequency changes) falls on all
of them alike. A side whose workers busy-wait after a call (vLLM's readers) is followed by a
pause long enough for them to stop, so that it never takes a core from the side timed after
it. Then the phase's sides are stopped, and start-up is measured one side at a time.

Two phases: first every side that does not need Ray, with no Ray process on the machine; then
Ray is started and the sides that need it are measured in the same way. Ray's own processes
(raylet, GCS, each actor's core-worker threads) take the CPU from whatever runs beside them,
far more often than the machine alone does (``benchmarks/machine_noise.py``): measured beside
them, a backend that never uses Ray would be timed with a cost its users never pay. A ratio
between sides of different phases compares each side in the conditions it brings.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._baselines import select_baselines
from ._options import PAYLOAD_KINDS
from ._overhead import Overhead, measure_imports, measure_overhead
from ._ray_session import RaySession
from ._sides import BenchUsageError, Side, SideSpec, Skipped, select_backends
from ._workloads import Plan, Row, make_payload

__all__ = ["Bench", "BenchConfig", "BenchResult", "run"]

#: Seconds to wait after a busy-waiting side's block: vLLM's readers spin for 1 s after
#: their last read before they block, and two spinning readers fill a small machine.
SETTLE_S = 1.2


@dataclass(frozen=True)
class BenchConfig:
    """What ``executor bench`` was asked to measure (its options, checked)."""

    #: Backend names or aliases; ``None``: every installed one.
    backends: Sequence[str] | None
    #: Baseline keys (``pipe``, ``ray``, ``vllm``).
    baselines: Sequence[str]
    sizes: Sequence[int]
    #: Payload kinds; ``None``: both, tensors only where torch is installed.
    kinds: Sequence[str] | None
    workloads: Sequence[str]
    #: Rounds; ``None``: the plan's default.
    repeats: int | None
    workers: int
    quick: bool
    idle_s: float
    vllm_path: str | None
    #: Load every installed plugin, not only those of the measured backends.
    all_plugins: bool = False
    progress: bool = True


@dataclass
class BenchResult:
    """Everything a run measured, and what it left out."""

    config: BenchConfig
    plan: Plan
    #: The sides measured (a failed one is not among them).
    sides: list[SideSpec]
    #: Sides that cannot run here (not installed, not standalone), with the reason.
    skipped: list[Skipped]
    #: Sides that failed once started (an error, a wrong reply), with the reason.
    failed: list[Skipped]
    #: The rows, in report order.
    rows: list[Row]
    #: (row key, side name) -> seconds per call.
    samples: dict[tuple[str, str], list[float]]
    #: Facts for the report: the plugins loaded, Ray's start, each phase's duration...
    facts: dict[str, str] = field(default_factory=dict)
    wall_s: float = 0.0
    #: The ``overhead`` workload's figures (None if not measured).
    overhead: Overhead | None = None
    #: The ``imports`` workload's ms per import, by label (None if not measured).
    imports: dict[str, float] | None = None

    def summary_rows(self) -> list[tuple[Row, SideSpec, list[float]]]:
        """Each (row, side) that has samples, in report order."""
        return [
            (row, side, self.samples[row.key, side.name])
            for row in self.rows
            for side in self.sides
            if self.samples.get((row.key, side.name))
        ]


class _SideFailed(Exception):
    pass


def _build_rows(config: BenchConfig, kinds: Sequence[str]) -> list[Row]:
    rows: list[Row] = []
    for workload in config.workloads:
        if workload == "payload":
            rows += [Row("payload", kind, size) for kind in kinds for size in config.sizes]
        elif workload == "startup":
            rows += [Row("startup"), Row("shutdown")]
        elif workload in ("imports", "overhead"):
            continue  # measured apart, in fresh interpreters or this process (_overhead)
        else:
            rows.append(Row(workload))
    return rows


def _restrict_plugins(backends: list[SideSpec], config: BenchConfig, facts: dict[str, str]) -> None:
    """Load only the measured backends' plugins (in this process and, through the config's
    env, in every worker): another installed plugin's hooks (an observer on every call)
    would be timed as part of every backend."""
    from executor_core.backend import PLUGINS_ENV_VAR, default_registry

    if PLUGINS_ENV_VAR in os.environ:
        facts["plugins"] = f"{PLUGINS_ENV_VAR}={os.environ[PLUGINS_ENV_VAR]} (as set)"
        return
    if config.all_plugins:
        facts["plugins"] = "every installed plugin (--all-plugins)"
        return
    names = sorted({side.plugin for side in backends})
    os.environ[PLUGINS_ENV_VAR] = ",".join(names)
    default_registry.cache_clear()
    facts["plugins"] = f"only the measured backends' ({', '.join(names) or 'none'})"


def _payload_kinds(config: BenchConfig, notes: list[str]) -> list[str]:
    has_torch = importlib.util.find_spec("torch") is not None
    if config.kinds is not None:
        if "tensor" in config.kinds and not has_torch:
            raise BenchUsageError("argument --kinds: tensor needs torch, which is not installed")
        return list(config.kinds)
    if not has_torch:
        notes.append("tensor payloads skipped: torch is not installed")
        return ["bytes"]
    return list(PAYLOAD_KINDS)


def _check(side: SideSpec, row: Row, result: list[Any]) -> None:
    expected = [row.size if row.workload == "payload" else None] * side.workers
    if result != expected:
        raise _SideFailed(f"{row.key}: returned {result!r:.200}, expected {expected!r:.200}")


def _is_unavailable(exc: BaseException) -> bool:
    """An error saying the side cannot run here (not installed, not configured for it)."""
    from executor_core import BackendLoadError, ConfigError, UnknownBackendError

    return isinstance(exc, BackendLoadError | ConfigError | UnknownBackendError | ImportError)


class Bench:
    """A run, prepared: the sides are selected (nothing is started until :meth:`measure`).

    Raises :class:`BenchUsageError` for an option that names something missing here (a
    backend, torch for tensor payloads).
    """

    def __init__(self, config: BenchConfig) -> None:
        self.began = time.perf_counter()
        self.config = config
        self.facts: dict[str, str] = {}
        self.notes: list[str] = []
        self.skipped: list[Skipped] = []
        self.failed: list[Skipped] = []
        self.samples: dict[tuple[str, str], list[float]] = {}
        self.live: dict[str, Side] = {}
        self.payloads: dict[str, Any] = {}
        #: Sides taken out of the run (skipped or failed).
        self.out: set[str] = set()
        backends, skipped = select_backends(config.backends, config.workers)
        self.skipped += skipped
        kinds = _payload_kinds(config, self.notes)
        _restrict_plugins(backends, config, self.facts)
        baselines, skipped = select_baselines(
            list(config.baselines), config.workers, config.vllm_path
        )
        self.skipped += skipped
        self.sides = backends + baselines
        self.plan = Plan.create(quick=config.quick, repeats=config.repeats, idle_s=config.idle_s)
        self.rows = _build_rows(config, kinds)

    # --- the phases ----------------------------------------------------------------------

    def measure(self) -> BenchResult:
        """Start the sides, measure every row, stop them; return what was measured."""
        config = self.config
        call_rows = [row for row in self.rows if row.workload in ("hot", "cold", "payload")]
        startup = "startup" in config.workloads
        for row in call_rows:
            if row.kind is not None and row.size is not None:
                self.payloads[row.key] = make_payload(row.kind, row.size)

        from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no type information

        n = len(self.sides)
        total = (n * (2 + self.plan.rounds) if call_rows else 0) + (
            n * self.plan.startup_samples if startup else 0
        )
        imports = overhead = None
        if "imports" in config.workloads:
            began = time.perf_counter()
            imports = measure_imports(repeats=3 if config.quick else 9)
            self.facts["imports"] = f"{time.perf_counter() - began:.0f} s, in fresh interpreters"
        if "overhead" in config.workloads:
            overhead = self._overhead()
        ray = RaySession()
        with tqdm(
            total=total, unit="step", disable=not config.progress, dynamic_ncols=True
        ) as self.bar:
            try:
                phases = []
                for with_ray in (False, True):
                    sides = [side for side in self.sides if side.needs_ray == with_ray]
                    if not sides:
                        continue
                    if with_ray and not self._start_ray(ray, sides):
                        continue
                    steps = []
                    if call_rows:
                        began = time.perf_counter()
                        self._calls(sides, call_rows)
                        steps.append(f"calls {time.perf_counter() - began:.0f} s")
                    if startup:
                        began = time.perf_counter()
                        self._startup(sides)
                        steps.append(f"start-up {time.perf_counter() - began:.0f} s")
                    names = ", ".join(side.name for side in sides)
                    where = "with Ray running" if with_ray else "no Ray process running"
                    phases.append(f"{names} ({where}): {', '.join(steps)}")
                self.facts["phases"] = "; then ".join(phases)
            finally:
                self._close_all()
                ray.close()
        measured = [side for side in self.sides if side.name not in self.out]
        if self.notes:
            self.facts["notes"] = "; ".join(self.notes)
        return BenchResult(
            config=config,
            plan=self.plan,
            sides=measured,
            skipped=self.skipped,
            failed=self.failed,
            rows=self.rows,
            samples={k: v for k, v in self.samples.items() if k[1] not in self.out},
            facts=self.facts,
            wall_s=time.perf_counter() - self.began,
            overhead=overhead,
            imports=imports,
        )

    def _start_ray(self, ray: RaySession, sides: list[SideSpec]) -> bool:
        """Start Ray for ``sides``; if it cannot start, they are out of the run (the other
        phase's results stand) and False is returned."""
        self.bar.set_description("starting Ray (once, for every Ray side)")
        try:
            ray.start(self.config.workers)
        except Exception as exc:  # noqa: BLE001  (reported with each Ray side, the run goes on)
            for side in sides:
                self._lost(side, "could not start", exc)
            return False
        self.facts["ray_start"] = f"{ray.start_s:.1f} s (not part of any row)"
        return True

    def _overhead(self) -> Overhead | None:
        """The ``overhead`` workload, first and alone (in this process, before any side)."""
        from executor_core.backend import Registry

        if "uni" not in Registry.from_entry_points(allow=["uniproc"]).names():
            self.notes.append("overhead: not measured (executor-plugin-uniproc not installed)")
            return None
        began = time.perf_counter()
        quick = self.config.quick
        result = measure_overhead(calls=2_000 if quick else 20_000, rounds=3 if quick else 7)
        self.facts["overhead"] = f"{time.perf_counter() - began:.0f} s, in this process"
        return result

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
            for _ in range(self.plan.calls(row)):
                if cold:
                    time.sleep(self.plan.idle_s)
                start = clock()
                result = live.call(method, args)
                out.append(clock() - start)
                _check(side, row, result)
        self._settle(side)

    def _args(self, row: Row) -> tuple[Any, ...]:
        return (self.payloads[row.key],) if row.workload == "payload" else ()

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
        lines = str(exc).strip().splitlines()
        entry = Skipped(
            side.name,
            side.role,
            f"{what}: {type(exc).__name__}" + (f": {lines[0]}" if lines else ""),
        )
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


def run(config: BenchConfig) -> BenchResult:
    """Measure what ``config`` selects: ``Bench(config).measure()``."""
    return Bench(config).measure()
