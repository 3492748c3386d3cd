"""Ray backend benchmark: this backend against raw Ray on the same kind of actor, side by side.

    .venv/bin/python benchmarks/bench_ray.py [--rounds 20] [--calls 25] [--large-rounds 10]
        [--large-calls 4] [--phases 20]

The backend at default options: Ray places and watches the actors, every call goes through
executor-channel (here, one node: the workers read the driver's shared-memory rings). In one
local Ray instance, for 1 and 2 workers:

* no-op ``collective_rpc("get_rank")`` against ``ray.get([a.get_rank.remote() ...])``;
* a 1 MB ``bytes`` argument (``payload_size``) against the same raw call with the same bytes;
* ``execute_model`` against the same raw actor calls, back to back and after 30 ms of sleep
  (every process idle, as between model steps);

interleaving the two sides in rounds so that the machine's noise hits both alike. With 2
workers, large arguments: 16 MiB of ``bytes`` and a 16 MiB CPU float32 tensor (each rank
returns its length, so only the argument travels), against two raw Ray sides interleaved
with it: ``ray.put`` once per call and the ref passed to both actors (the data enters Ray's
object store once, as it enters the channel once; target: this backend <= 1.0x), and the
value passed directly (Ray puts an argument over 100 KiB into its object store per actor
call). Each of those rows repeats this backend's samples against one raw side.

Then ``execute_model`` through a raw Ray Compiled Graph (``InputNode -> each raw actor's
step -> MultiOutputNode``, ``experimental_compile``) as the baseline for this backend's
``execute_model`` on the channel: the compiled-graph path the backend used to offer was to
stay only if it measurably beat the channel. A live graph's loops spin while idle and would
take a core from the side being measured, so the sides run in alternating phases, the raw
graph compiled at the start of each of its phases and torn down at its end; a phase's median
moves with each compile (figures: docs/benchmarks.md, ray), so the row pools ``--phases``
phases per side, and a 95% bootstrap interval over the phase pairs is printed under the
table. Skipped, with the reason printed, if Ray's compiled graphs are unavailable
(``--phases 0`` skips them too).

The raw actors are threaded actors with a second concurrency group, as the backend's are.
Only the plugin under test is loaded (``EXECUTOR_PLUGINS=ray``, in the driver and, through the
config's ``env``, in the workers; checked at start): the development install also registers
test fixtures, among them an observer hook that runs on every call.
Prints median and p99 per call in microseconds and the ratio of medians.
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

from executor_core import create_executor
from executor_core._registry import default_registry
from executor_core.testing import conformance_config
from executor_plugin_ray._cluster import acquire_ray
from executor_plugin_ray._executor import RayExecutor
from executor_plugin_ray._options import RayOptions

MB = b"x" * (1 << 20)
MIB = 1 << 20
#: The large arguments: 16 MiB, the channel's default slot size (so with its header a
#: message spans two slots, as any argument above the slot does).
LARGE_BYTES = 16 * MIB
#: Only the plugin under test is loaded, in the driver and the workers: the development
#: install also registers test fixtures, among them an observer hook that would add its own
#: cost to every call.
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

    def payload_size(self, data: Any) -> int:
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


def compare_sides(
    sides: dict[str, Callable[[], Any]],
    rounds: int,
    calls: int,
    pause: float = 0.0,
) -> dict[str, list[float]]:
    """Each side's samples, the sides interleaved in ``rounds`` rounds of ``calls`` calls
    after a warm-up of ``calls`` calls each; which side goes first rotates."""
    for call in sides.values():  # warm-up, not measured
        for _ in range(calls):
            call()
    samples: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for i in range(rounds):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            timed(sides[name], calls, samples[name], pause)
    return samples


def compare(
    ours: Callable[[], Any],
    raw: Callable[[], Any],
    rounds: int,
    calls: int,
    pause: float = 0.0,
) -> tuple[list[float], list[float]]:
    samples = compare_sides({"ours": ours, "raw": raw}, rounds, calls, pause)
    return samples["ours"], samples["raw"]


def row(case: str, workers: int, ours: list[float], raw: list[float]) -> str:
    def us(x: float) -> str:
        return f"{x * 1e6:,.0f}"

    mo, mr = statistics.median(ours), statistics.median(raw)
    return (
        f"| {case} | {workers} | {us(mo)} | {us(percentile(ours, 0.99))} | {us(mr)} | "
        f"{us(percentile(raw, 0.99))} | {mo / mr:.2f}x |"
    )


#: The options the runs set (tuned): the actors' output is not streamed to the driver.
TUNED_OPTIONS = {"log_to_driver": False}


def _executor(workers: int) -> RayExecutor:
    """This backend at default options (only the actors' output is not forwarded)."""
    executor = create_executor(
        conformance_config(
            "ray",
            world_size=workers,
            backend_options=TUNED_OPTIONS,
            env={PLUGINS_ENV: "ray"},
        )
    )
    assert isinstance(executor, RayExecutor)
    # One node: every rank reads the driver's rings, none goes through the hub.
    assert executor.ranks_on_rings == tuple(range(workers)), executor.ranks_on_rings
    assert executor.ranks_on_hub == (), executor.ranks_on_hub
    check_plugins(executor)
    return executor


def check_plugins(executor: RayExecutor) -> None:
    """Only the plugin under test is loaded: in this process, and set for the workers."""
    loaded = sorted(default_registry().plugins)
    assert loaded == ["ray"], f"plugins loaded in the driver: {loaded}"
    seen = executor.collective_rpc("get_env", args=(PLUGINS_ENV,))
    assert seen == ["ray"] * len(seen), f"{PLUGINS_ENV} in the workers: {seen}"


def _raw_actors(workers: int) -> list[Any]:
    actors = [RawActor.remote(rank) for rank in range(workers)]
    ray.get([a.pid.remote() for a in actors])
    return actors


def bench_calls(executor: RayExecutor, actors: list[Any], rounds: int, calls: int) -> list[str]:
    """Calls of every size a step sends, against the same raw actor calls."""
    workers = len(actors)
    rows = []
    ours, raw = compare(
        lambda: executor.collective_rpc("get_rank"),
        lambda: ray.get([a.get_rank.remote() for a in actors]),
        rounds,
        calls,
    )
    rows.append(row("no-op collective_rpc", workers, ours, raw))
    ours, raw = compare(
        lambda: executor.collective_rpc("payload_size", args=(MB,)),
        lambda: ray.get([a.payload_size.remote(MB) for a in actors]),
        rounds,
        max(1, calls // 2),
    )
    rows.append(row("1 MB argument", workers, ours, raw))
    ours, raw = compare(
        lambda: executor.execute_model(1),
        lambda: ray.get([a.step.remote(1) for a in actors]),
        rounds,
        calls,
    )
    rows.append(row("execute_model", workers, ours, raw))
    # What a model step pays: the call after the workers and the driver slept 30 ms.
    ours, raw = compare(
        lambda: executor.execute_model(1),
        lambda: ray.get([a.step.remote(1) for a in actors]),
        max(2, rounds // 2),
        max(2, calls // 2),
        pause=0.03,
    )
    rows.append(row("execute_model after 30 ms idle", workers, ours, raw))
    return rows


def _put_once(actors: list[Any], value: Any) -> list[int]:
    ref = ray.put(value)
    return ray.get([a.payload_size.remote(ref) for a in actors])


def _pass_value(actors: list[Any], value: Any) -> list[int]:
    return ray.get([a.payload_size.remote(value) for a in actors])


def bench_large(executor: RayExecutor, actors: list[Any], rounds: int, calls: int) -> list[str]:
    """16 MiB of bytes and a 16 MiB tensor to every worker, against raw Ray with one
    ``ray.put`` per call and its ref passed to every actor, and with the value passed to
    each actor directly; the three sides interleaved."""
    import torch

    workers = len(actors)
    payloads = {
        "16 MiB bytes": os.urandom(LARGE_BYTES),
        "16 MiB float32 tensor": torch.rand(LARGE_BYTES // 4, dtype=torch.float32),
    }
    rows = []
    for name, value in payloads.items():
        expected = [len(value)] * workers
        assert executor.collective_rpc("payload_size", args=(value,)) == expected
        assert _put_once(actors, value) == expected
        samples = compare_sides(
            {
                "ours": functools.partial(executor.collective_rpc, "payload_size", args=(value,)),
                "put": functools.partial(_put_once, actors, value),
                "value": functools.partial(_pass_value, actors, value),
            },
            rounds,
            calls,
        )
        ours = samples["ours"]
        rows.append(row(f"{name} vs raw `ray.put` once + refs", workers, ours, samples["put"]))
        rows.append(row(f"{name} vs raw value passed", workers, ours, samples["value"]))
    return rows


def _raw_graph_step(graph: Any) -> Any:
    return ray.get(graph.execute(1))


def compiled_graph_unavailable() -> str | None:
    """Why Ray's compiled graphs cannot run here, or None if they can."""
    try:
        from ray.dag import InputNode, MultiOutputNode  # noqa: F401
    except ImportError as exc:
        return f"ray.dag does not import: {exc}"
    return None


def bench_compiled(
    executor: RayExecutor, actors: list[Any], phases: int, calls: int
) -> tuple[str, str]:
    """This backend's ``execute_model`` on the channel against a raw compiled graph on the
    raw actors, in alternating phases with no graph alive during this backend's phases: a
    live graph's loops spin while idle and would take a core from the side being measured.
    Each raw phase compiles its graph again on the same actors and tears it down at its end.

    A phase's median moves with each compile (docs/benchmarks.md, ray), so the row
    pools many short phases, and the returned note gives a 95% bootstrap interval of the
    ratio over the phase pairs. Returns (table row, note)."""
    from ray.dag import InputNode, MultiOutputNode

    workers = len(actors)
    step = functools.partial(executor.execute_model, 1)

    def ours_phase(out: list[float]) -> None:
        timed(step, calls, [])  # warm-up
        time.sleep(SETTLE_S)
        timed(step, calls * 4, out)

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
    for phase in range(phases):
        ours_phase_s: list[float] = []
        raw_phase_s: list[float] = []
        for side in ("ours", "raw") if phase % 2 == 0 else ("raw", "ours"):
            if side == "ours":
                ours_phase(ours_phase_s)
            else:
                raw_phase(raw_phase_s)
        pairs.append((ours_phase_s, raw_phase_s))
    ours = [s for pair in pairs for s in pair[0]]
    raw = [s for pair in pairs for s in pair[1]]
    low, high = _bootstrap_ratio_interval(pairs)
    note = (
        f"channel execute_model against a raw compiled graph, {workers} worker(s): median "
        f"ratio {statistics.median(ours) / statistics.median(raw):.2f}x, 95% interval "
        f"{low:.2f}-{high:.2f}x (bootstrap over {len(pairs)} phase pairs)"
    )
    return row("execute_model vs raw compiled graph", workers, ours, raw), note


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
    parser.add_argument("--large-rounds", type=int, default=10, help="rounds of 16 MiB calls")
    parser.add_argument("--large-calls", type=int, default=4, help="16 MiB calls per round")
    parser.add_argument(
        "--phases",
        type=int,
        default=20,
        help="compiled-graph phases per side (single phases vary by 2x on 2 cores; 0: skip)",
    )
    args = parser.parse_args()
    os.environ[PLUGINS_ENV] = "ray"
    compiled_skip = "--phases 0" if args.phases <= 0 else compiled_graph_unavailable()
    # One local instance for the whole run, started the way the backend starts one.
    lease = acquire_ray(RayOptions(local_num_cpus=4, log_to_driver=False), world_size=4)
    try:
        print(f"ours: tuned, backend_options={TUNED_OPTIONS} (the rest at default options)\n")
        print(
            "| case | workers | ours median µs | ours p99 µs | raw Ray median µs | "
            "raw Ray p99 µs | median ratio |"
        )
        print("|---|---|---|---|---|---|---|")
        notes = []
        for workers in (1, 2):
            executor = _executor(workers)
            actors = _raw_actors(workers)
            try:
                for line in bench_calls(executor, actors, args.rounds, args.calls):
                    print(line, flush=True)
                if workers == 2:
                    for line in bench_large(executor, actors, args.large_rounds, args.large_calls):
                        print(line, flush=True)
                if compiled_skip is None:
                    try:
                        compiled_row, note = bench_compiled(
                            executor, actors, args.phases, args.calls
                        )
                    except Exception as exc:  # noqa: BLE001 - the baseline is optional
                        compiled_skip = f"{type(exc).__name__}: {exc}"
                    else:
                        print(compiled_row, flush=True)
                        notes.append(note)
            finally:
                for actor in actors:
                    ray.kill(actor)
                executor.shutdown()
        if compiled_skip is not None:
            notes.append(f"raw compiled-graph rows skipped: {compiled_skip}")
        print()
        for note in notes:
            print(f"* {note}")
    finally:
        lease.release()


if __name__ == "__main__":
    main()
