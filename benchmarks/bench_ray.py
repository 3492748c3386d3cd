"""Ray backend benchmark: this backend against raw Ray on the same kind of actor, side by side.

    .venv/bin/python benchmarks/bench_ray.py [--rounds 20] [--calls 25] [--phases 60]

For 1 and 2 workers, in one Ray instance, on each of the backend's call paths (direct calls,
the default on one node, and Ray actor calls, ``direct_calls=False``, as across nodes):

* no-op ``collective_rpc("get_rank")`` against ``ray.get([a.get_rank.remote() ...])``;
* a 1 MB argument (``payload_size``) against the same raw call with the same bytes;
* ``execute_model`` (not through a compiled graph) against the same raw calls, back to back
  and after 30 ms of sleep (every process idle, as between model steps);

interleaving the two sides in rounds so that the machine's noise hits both alike, with no
compiled graph alive; then

* ``execute_model`` through the compiled-graph path (``compiled_graph=True``) against a raw
  Ray Compiled Graph (``InputNode -> one bind per actor -> MultiOutputNode``), in
  alternating phases with only one graph alive at a time: Ray's graph loops spin while
  idle, so a graph left alive would take a core from the side being measured. Each phase
  compiles its graph again on the same actors; a phase's median moves by up to 2x from one
  compile to the next here, so the row pools ``--phases`` phases per side, and a 95%
  bootstrap interval over the phase pairs is printed under the table. And, free of that
  noise, the executor's ``execute_model`` against Ray's own ``execute`` on the executor's
  live graph: what the executor adds on the driver.

The raw actors are threaded actors with a second concurrency group, as the backend's are.
Only the plugin under test is loaded (``EXECUTOR_PLUGINS=ray``): the development install also
registers test fixtures, among them an observer hook that runs on every call.
Prints median and p99 per call in microseconds and the ratio of medians (target <= 1.1).
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.dag import InputNode, MultiOutputNode

from executor_core import create_executor
from executor_core.testing import conformance_config
from executor_plugin_ray._cluster import acquire_ray
from executor_plugin_ray._executor import RayExecutor
from executor_plugin_ray._options import RayOptions

MB = b"x" * (1 << 20)
#: Only the plugin under test is loaded, in the driver and the workers: the development
#: install also registers test fixtures, among them an observer hook that runs on every call
#: (about 4 µs a call here).
PLUGINS_ENV = "EXECUTOR_PLUGINS"
#: Seconds a compiled-graph phase waits after compiling and warming up, before it measures:
#: compiling keeps Ray's own processes busy for a moment. Both sides wait alike.
SETTLE_S = 0.3


@ray.remote(num_cpus=1, concurrency_groups={"monitor": 2})
class RawActor:
    """The baseline: the same methods, with no executor in between."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def get_rank(self) -> int:
        return self.rank

    def payload_size(self, data: bytes) -> int:
        return len(data)

    def step(self, batch: Any) -> Any:
        return {"rank": self.rank, "batch": batch}

    def pid(self) -> int:
        return os.getpid()


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timed(fn: Callable[[], Any], calls: int, out: list[float], pause: float = 0.0) -> None:
    """Time ``calls`` calls of ``fn`` into ``out``; ``pause`` seconds of sleep (not timed)
    before each let every process go idle first, as between the steps of a model."""
    for _ in range(calls):
        if pause:
            time.sleep(pause)
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)


def compare(
    ours: Callable[[], Any],
    raw: Callable[[], Any],
    rounds: int,
    calls: int,
    pause: float = 0.0,
) -> tuple[list[float], list[float]]:
    for _ in range(calls):  # warm-up, not measured
        ours()
        raw()
    ours_s: list[float] = []
    raw_s: list[float] = []
    for i in range(rounds):
        # Alternate which side goes first, so that neither always follows the other.
        first, second = (
            ((ours, ours_s), (raw, raw_s)) if i % 2 == 0 else ((raw, raw_s), (ours, ours_s))
        )
        timed(first[0], calls, first[1], pause)
        timed(second[0], calls, second[1], pause)
    return ours_s, raw_s


def row(case: str, workers: int, ours: list[float], raw: list[float]) -> str:
    def us(x: float) -> str:
        return f"{x * 1e6:,.0f}"

    mo, mr = statistics.median(ours), statistics.median(raw)
    return (
        f"| {case} | {workers} | {us(mo)} | {us(percentile(ours, 0.99))} | {us(mr)} | "
        f"{us(percentile(raw, 0.99))} | {mo / mr:.2f}x |"
    )


def _executor(workers: int, compiled_graph: bool, direct_calls: bool = True) -> RayExecutor:
    options = {
        "log_to_driver": False,
        "compiled_graph": compiled_graph,
        "direct_calls": direct_calls,
    }
    executor = create_executor(
        conformance_config(
            "ray", world_size=workers, backend_options=options, env={PLUGINS_ENV: "ray"}
        )
    )
    assert isinstance(executor, RayExecutor)
    assert executor.uses_compiled_graph == compiled_graph
    assert executor.uses_direct_calls == direct_calls
    return executor


def bench_calls(workers: int, rounds: int, calls: int, direct_calls: bool) -> list[str]:
    """Calls on one path, no compiled graph alive on either side (its loops spin and would
    steal the cores from whichever side is measured)."""
    path = "direct" if direct_calls else "actor calls"
    executor = _executor(workers, compiled_graph=False, direct_calls=direct_calls)
    actors = [RawActor.remote(rank) for rank in range(workers)]
    ray.get([a.get_rank.remote() for a in actors])
    rows = []
    try:
        ours, raw = compare(
            lambda: executor.collective_rpc("get_rank"),
            lambda: ray.get([a.get_rank.remote() for a in actors]),
            rounds,
            calls,
        )
        rows.append(row(f"no-op collective_rpc ({path})", workers, ours, raw))
        ours, raw = compare(
            lambda: executor.collective_rpc("payload_size", args=(MB,)),
            lambda: ray.get([a.payload_size.remote(MB) for a in actors]),
            rounds,
            max(1, calls // 2),
        )
        rows.append(row(f"1 MB argument ({path})", workers, ours, raw))
        ours, raw = compare(
            lambda: executor.execute_model(1),
            lambda: ray.get([a.step.remote(1) for a in actors]),
            rounds,
            calls,
        )
        rows.append(row(f"execute_model ({path})", workers, ours, raw))
        # What a model step pays: the call after the workers and the driver slept 30 ms.
        ours, raw = compare(
            lambda: executor.execute_model(1),
            lambda: ray.get([a.step.remote(1) for a in actors]),
            max(2, rounds // 2),
            max(2, calls // 2),
            pause=0.03,
        )
        rows.append(row(f"execute_model after 30 ms idle ({path})", workers, ours, raw))
    finally:
        for actor in actors:
            ray.kill(actor)
        executor.shutdown()
    return rows


class _Internals:
    """The executor's actors and compiled graph, wherever this version keeps them: on its
    transport (``executor._transport``), or on the executor itself before the transport
    contract, so that this benchmark runs on either tree."""

    def __init__(self, executor: RayExecutor) -> None:
        self._holder: Any = getattr(executor, "_transport", executor)

    @property
    def actors(self) -> list[Any]:
        holder = self._holder
        actors: list[Any] = getattr(holder, "actors", None) or holder._actors
        return actors

    @property
    def _compiled(self) -> Any:
        return self._holder._compiled


def _internals(executor: RayExecutor) -> _Internals:
    return _Internals(executor)


def _raw_graph_step(graph: Any) -> Any:
    return ray.get(graph.execute(1))


def bench_compiled(workers: int, phases: int, calls: int) -> tuple[str, str]:
    """The compiled-graph path against a raw compiled graph on the same executor and the same
    raw actors for the whole run, in alternating phases with one graph live at a time: a
    live graph's loops spin while idle and would take a core from the side being measured.
    Between phases this backend's graph is released (``release_compiled_graph``) and the raw
    one torn down; each phase compiles its graph again.

    A phase's median moves by up to 2x from one compile to the next on 2 cores, on either
    side, so the row pools many short phases, and the returned note gives a 95% bootstrap
    interval of the ratio over the phase pairs. Returns (table row, note)."""
    executor = _executor(workers, compiled_graph=True)
    actors = [RawActor.remote(rank) for rank in range(workers)]
    ray.get([a.pid.remote() for a in actors])

    def ours_phase(out: list[float]) -> None:
        step = functools.partial(executor.execute_model, 1)
        try:
            timed(step, calls, [])  # compiles the graph, then warms up
            time.sleep(SETTLE_S)
            timed(step, calls * 4, out)
        finally:
            executor.release_compiled_graph()

    def raw_phase(out: list[float]) -> None:
        with InputNode() as inp:
            dag = MultiOutputNode([a.step.bind(inp) for a in actors])
        graph = dag.experimental_compile()
        try:
            raw_step = functools.partial(_raw_graph_step, graph)
            timed(raw_step, calls, [])
            time.sleep(SETTLE_S)
            timed(raw_step, calls * 4, out)
        finally:
            graph.teardown()

    pairs: list[tuple[list[float], list[float]]] = []
    try:
        for phase in range(phases):
            ours_phase_s: list[float] = []
            raw_phase_s: list[float] = []
            for side in ("ours", "raw") if phase % 2 == 0 else ("raw", "ours"):
                if side == "ours":
                    ours_phase(ours_phase_s)
                else:
                    raw_phase(raw_phase_s)
            pairs.append((ours_phase_s, raw_phase_s))
    finally:
        for actor in actors:
            ray.kill(actor)
        executor.shutdown()
    ours = [s for pair in pairs for s in pair[0]]
    raw = [s for pair in pairs for s in pair[1]]
    low, high = _bootstrap_ratio_interval(pairs)
    note = (
        f"compiled graph, {workers} worker(s): median ratio "
        f"{statistics.median(ours) / statistics.median(raw):.2f}x, 95% interval {low:.2f}-"
        f"{high:.2f}x (bootstrap over {len(pairs)} phase pairs)"
    )
    return row("execute_model (compiled graph)", workers, ours, raw), note


def bench_compiled_driver(workers: int, rounds: int, calls: int) -> str:
    """What the executor adds on the driver, free of the compile-to-compile noise: its
    ``execute_model`` against ``ray.get(graph.execute(batch))`` on the very same live graph
    (so the same actors, channels and worker code), in alternating blocks."""
    executor = _executor(workers, compiled_graph=True)
    try:
        executor.execute_model(1)  # compiles the graph
        # A private attribute: the only way to drive the executor's own graph directly.
        graph = _internals(executor)._compiled._graph
        ours, raw = compare(
            functools.partial(executor.execute_model, 1),
            functools.partial(_raw_graph_step, graph),
            rounds,
            calls,
        )
    finally:
        executor.shutdown()
    return row("execute_model (compiled graph), same graph driven raw", workers, ours, raw)


def compiled_worker_cost() -> str:
    """What the executor adds in the worker per compiled step, timed inside the actor."""

    # Nested, so that Ray ships it by value even when this module is imported.
    def time_in_actor(actor: Any, calls: int = 20_000) -> tuple[float, float]:
        """Seconds per call of the actor's compiled-graph stage method and of the worker's
        own ``execute_model`` (the best of 5 loops of ``calls`` calls)."""
        import timeit

        worker = actor._wrapper.worker

        def best(fn: Callable[[], Any]) -> float:
            return min(timeit.repeat(fn, number=calls, repeat=5)) / calls

        return best(lambda: actor.execute_model_compiled(1)), best(lambda: worker.execute_model(1))

    executor = _executor(1, compiled_graph=True)
    try:
        # A private attribute: the actor handle, to time its method where it runs.
        actor = _internals(executor).actors[0]
        stage_s, worker_s = ray.get(actor.__ray_call__.remote(time_in_actor))
    finally:
        executor.shutdown()
    return (
        f"compiled graph, in the worker: the stage method takes {stage_s * 1e6:.1f} µs a call, "
        f"the worker's own execute_model {worker_s * 1e6:.1f} µs (best of 5 x 20,000 calls)"
    )


def _bootstrap_ratio_interval(
    pairs: list[tuple[list[float], list[float]]], resamples: int = 1000
) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of the ratio of pooled medians when the phase pairs
    are drawn again with replacement (fixed seed: the same data gives the same interval)."""
    draw = random.Random(0)
    ratios = []
    for _ in range(resamples):
        chosen = [draw.choice(pairs) for _ in pairs]
        ours = [s for pair in chosen for s in pair[0]]
        raw = [s for pair in chosen for s in pair[1]]
        ratios.append(statistics.median(ours) / statistics.median(raw))
    ratios.sort()
    return ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=25)
    parser.add_argument(
        "--phases",
        type=int,
        default=60,
        help="compiled-graph phases per side (single phases vary by 2x on 2 cores)",
    )
    args = parser.parse_args()
    os.environ[PLUGINS_ENV] = "ray"
    # One local instance for the whole run, started the way the backend starts one.
    lease = acquire_ray(RayOptions(local_num_cpus=4, log_to_driver=False), world_size=4)
    try:
        print(
            "| case | workers | ours median µs | ours p99 µs | raw Ray median µs | "
            "raw Ray p99 µs | median ratio |"
        )
        print("|---|---|---|---|---|---|---|")
        notes = []
        for workers in (1, 2):
            for direct_calls in (True, False):
                for line in bench_calls(workers, args.rounds, args.calls, direct_calls):
                    print(line, flush=True)
            compiled_row, note = bench_compiled(workers, args.phases, args.calls)
            print(compiled_row, flush=True)
            print(bench_compiled_driver(workers, args.rounds, args.calls), flush=True)
            notes.append(note)
        notes.append(compiled_worker_cost())
        print()
        for note in notes:
            print(f"* {note}")
    finally:
        lease.release()


if __name__ == "__main__":
    main()
