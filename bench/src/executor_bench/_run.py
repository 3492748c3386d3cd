"""One benchmark run: select the sides, measure them in two phases, return every sample.

Each phase runs the timing loop (``_timing.py``) over its sides. First every side that does
not need Ray, with no Ray process on the machine; then Ray is started and the sides that need
it are measured in the same way. Ray's own processes (raylet, GCS, each actor's core-worker
threads) take the CPU from whatever runs beside them, more often than the machine alone does
(on a 2-core VM, a busy process lost its core half as often again): measured beside them, a
backend that never uses Ray would be timed with a cost its users never pay. A ratio between
sides of different phases compares each side in the conditions it brings.
"""

from __future__ import annotations

import contextlib
import importlib
import time

from ._baselines import select_baselines
from ._config import BenchConfig
from ._nodes import select_node_sides
from ._options import APART
from ._overhead import Overhead, measure_imports, measure_overhead
from ._ray_session import RaySession
from ._result import BenchResult, Table
from ._selection import build_rows, payload_kinds, restrict_plugins
from ._sides import SideSpec, Skipped, select_backends
from ._slurm import select_slurm_sides, slurm_job
from ._timing import TimingLoop, describe
from ._workloads import Plan, make_payload

__all__ = ["Bench"]


class Bench(TimingLoop):
    """A run, prepared: the sides are selected (nothing is started until :meth:`measure`).

    Raises :class:`BenchUsageError` for an option that names something missing here (a
    backend, torch for tensor payloads).
    """

    def __init__(self, config: BenchConfig) -> None:
        self.began = time.perf_counter()
        super().__init__()
        self.config = config
        self.facts: dict[str, str] = {}
        self.notes: list[str] = []
        backends, skipped = select_backends(config.backends, config.workers)
        self.skipped += skipped
        kinds = payload_kinds(config, self.notes)
        baselines, skipped = select_baselines(
            list(config.baselines), config.workers, config.vllm_path
        )
        self.skipped += skipped
        self.sides = backends + baselines
        if "nodes" in config.workloads:
            nodes, skipped = select_node_sides(backends, config.vllm_path)
            self.sides += nodes
            self.skipped += skipped
        if "slurm" in config.workloads:
            slurm, skipped = select_slurm_sides(backends)
            self.sides += slurm
            self.skipped += skipped
        restrict_plugins(self.sides, config, self.facts)
        # A side takes part in some workloads only: one with none of this run's is not started.
        self.sides = [side for side in self.sides if side.workloads & set(config.workloads)]
        self.plan = Plan.create(quick=config.quick, repeats=config.repeats, idle_s=config.idle_s)
        self.rows = build_rows(config, kinds)
        self.backends = [side.name for side in backends]
        #: The workloads measured apart that can run here (the others are skipped).
        self.apart: list[str] = []
        for name in (name for name in config.workloads if name in APART):
            reason = importlib.import_module(APART[name], __package__).missing()
            if reason:
                self.skipped.append(Skipped(name, "workload", reason))
            else:
                self.apart.append(name)

    # --- the phases ----------------------------------------------------------------------

    def measure(self) -> BenchResult:
        """Start the sides, measure every row, stop them; return what was measured."""
        config = self.config
        call_rows = [row for row in self.rows if row.workload not in ("startup", "shutdown")]
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
        with (
            tqdm(
                total=total, unit="step", disable=not config.progress, dynamic_ncols=True
            ) as self.bar,
            contextlib.ExitStack() as stack,
        ):
            try:
                phases = []
                for with_ray in (False, True):
                    sides = [side for side in self.sides if side.needs_ray == with_ray]
                    if not with_ray:
                        sides = self._start_slurm(stack, sides)
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
                if phases:
                    self.facts["phases"] = "; then ".join(phases)
            finally:
                self._close_all()
                ray.close()
                stack.close()  # the Slurm job and cluster, if any
        tables = [table for name in self.apart for table in self._apart(name)]
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
            round_calls={k: v for k, v in self.round_calls.items() if k[1] not in self.out},
            facts=self.facts,
            wall_s=time.perf_counter() - self.began,
            overhead=overhead,
            imports=imports,
            tables=tables,
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

    def _start_slurm(self, stack: contextlib.ExitStack, sides: list[SideSpec]) -> list[SideSpec]:
        """Start the Slurm cluster and job if any of ``sides`` needs them; ``sides`` without
        those that need them if they cannot start (reported with each)."""
        slurm = [side for side in sides if "slurm" in side.workloads]
        if not slurm:
            return sides
        self.bar.set_description("starting a Slurm cluster and a job of 2 nodes")
        try:
            stack.enter_context(slurm_job())
        except Exception as exc:  # noqa: BLE001  (reported with each Slurm side, the run goes on)
            for side in slurm:
                self._lost(side, "could not start", exc)
            return [side for side in sides if side not in slurm]
        return sides

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

    def _apart(self, name: str) -> list[Table]:
        """The workload ``name`` of :data:`APART`, in this process, after the sides: its
        tables (none if it failed: it is reported with the failed sides)."""
        module = importlib.import_module(APART[name], __package__)
        quick = self.config.quick
        rounds = self.config.repeats or (1 if quick else module.ROUNDS)
        began = time.perf_counter()
        try:
            tables: list[Table] = module.measure(rounds, quick, self.backends)
        except Exception as exc:  # noqa: BLE001  (reported with the workload, the run goes on)
            self.failed.append(Skipped(name, "workload", describe("failed", exc)))
            return []
        self.facts[name] = f"{time.perf_counter() - began:.0f} s"
        return tables
