"""Ray backend benchmark: this backend against raw Ray on the same kind of actor, side by side.

    .venv/bin/python benchmarks/bench_ray.py [--rounds 20] [--calls 25] [--large-rounds 10]
        [--large-calls 4] [--phases 20]
    .venv/bin/python benchmarks/bench_ray.py --nodes [--rounds 10] [--calls 25]

Tuned: ``log_to_driver=False`` (and ``placement_strategy="SPREAD"`` with ``--nodes``), else
default options; ``executor bench``'s worker, sides (the raw actors: ``RayActorsSide``, one
CPU and a second concurrency group each, as the backend's actors have) and timing loop.

One node (one local Ray instance; the workers read the driver's rings), 1 and 2 workers: a
no-op, a 1 MB ``bytes`` argument (raw Ray gets the value), ``execute_model`` back to back and
after 30 ms of sleep. With 2 workers, 16 MiB of ``bytes`` and a 16 MiB float32 tensor against
raw Ray with one ``ray.put`` per call (its ref to both actors) and with the value passed.
Then ``execute_model`` against a raw Ray Compiled Graph on the raw actors, in alternating
phases (a live graph spins; each raw phase compiles and tears down its own), ``--phases``
phases per side pooled, with a 95% bootstrap interval over the phase pairs (``--phases 0``
skips it).

``--nodes``: a simulated cluster on loopback (a head node without CPUs, where the driver
runs, and two worker nodes of 4 CPUs), one rank per worker node, both through the hub;
raw actors spread alike; the no-op, ``execute_model`` (and after idle), and 1 MB (also
against ``ray.put`` once + refs).
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

from executor_bench import (
    BackendSide,
    RayActorsSide,
    RaySession,
    interleave,
    make_payload,
    markdown_table,
    percentile,
)
from executor_core.backend import PLUGINS_ENV_VAR, default_registry

MB = b"x" * (1 << 20)
LARGE = 16 << 20  # the channel's default slot: with its header, a message spans two
SETTLE_S = 0.3  # after a compiled-graph phase's compile and warm-up, before it measures
RAW_ACTOR = {"num_cpus": 1, "concurrency_groups": {"monitor": 2}}
RAW = "raw Ray"
GRAPH = "raw compiled graph"
HEADER = ["case", "workers", "side", "median µs", "p99 µs", "ratio to raw Ray"]


def rows(
    case: str, workers: int, samples: dict[str, list[float]], raw: str = "raw Ray"
) -> list[list[Any]]:
    base = statistics.median(samples[raw])
    out = []
    for name, got in samples.items():
        median = statistics.median(got)
        p99 = percentile(got, 0.99)
        cells = [f"{median * 1e6:,.0f}", f"{p99 * 1e6:,.0f}", f"{median / base:.2f}x"]
        out.append([case, workers, name, *cells])
        print(f"| {' | '.join(map(str, out[-1]))} |", flush=True)
    return out


def calls(
    ours: BackendSide, raw: RayActorsSide, workers: int, a: argparse.Namespace
) -> list[list[Any]]:
    """The calls of a model step, each against the same raw actor calls."""

    def both(method: str, *args: Any) -> dict[str, Callable[[], Any]]:
        return {
            "ours": functools.partial(ours.call, method, args),
            RAW: functools.partial(raw.call, method, args),
        }

    step = {**both("execute_model", 1), "ours": functools.partial(ours.executor.execute_model, 1)}
    one_mb = both("size_of", MB)
    if a.nodes:
        one_mb["raw Ray, `ray.put` once + refs"] = functools.partial(put_once, raw, MB)
    n, half = a.calls, max(1, a.calls // 2)
    out = rows("no-op collective_rpc", workers, interleave(both("noop"), a.rounds, n, warmup=n))
    out += rows("1 MB argument", workers, interleave(one_mb, a.rounds, half, warmup=n))
    out += rows("execute_model", workers, interleave(step, a.rounds, n, warmup=n))
    idle = interleave(step, max(2, a.rounds // 2), max(2, half), warmup=n, pause_s=0.03)
    return out + rows("execute_model after 30 ms idle", workers, idle)


def put_once(raw: RayActorsSide, value: Any) -> list[Any]:
    import ray

    ref = ray.put(value)
    return list(ray.get([actor.size_of.remote(ref) for actor in raw.actors]))


def large(ours: BackendSide, raw: RayActorsSide, a: argparse.Namespace) -> list[list[Any]]:
    """16 MiB to both workers: against ``ray.put`` once + refs, and the value passed."""
    out = []
    payloads = {"16 MiB bytes": os.urandom(LARGE), "16 MiB float32 tensor": None}
    payloads["16 MiB float32 tensor"] = make_payload("tensor", LARGE)
    for name, value in payloads.items():
        sides = {
            "ours": functools.partial(ours.call, "size_of", (value,)),
            "raw `ray.put` once + refs": functools.partial(put_once, raw, value),
            "raw value passed": functools.partial(raw.call, "size_of", (value,)),
        }
        assert all(call() == [LARGE, LARGE] for call in sides.values())
        samples = interleave(sides, a.large_rounds, a.large_calls, warmup=a.large_calls)
        for vs in list(sides)[1:]:
            out += rows(f"{name} vs {vs}", 2, {"ours": samples["ours"], vs: samples[vs]}, vs)
    return out


def compiled(
    ours: BackendSide, raw: RayActorsSide, workers: int, phases: int, n: int
) -> tuple[list[list[Any]], str]:
    """``execute_model`` on the channel against a raw compiled graph, alternating phases."""
    import ray
    from ray.dag import InputNode, MultiOutputNode

    def phase(step: Callable[[], Any]) -> list[float]:
        interleave({"": step}, 1, n)  # warm-up
        time.sleep(SETTLE_S)
        return interleave({"": step}, 1, n * 4)[""]

    def raw_phase() -> list[float]:
        with InputNode() as inp:
            dag = MultiOutputNode([actor.execute_model.bind(inp) for actor in raw.actors])
        graph = dag.experimental_compile()
        try:
            return phase(lambda: ray.get(graph.execute(1)))
        finally:
            graph.teardown()

    pairs = []
    for turn in range(phases):
        got = {}
        for side in ("ours", "raw") if turn % 2 == 0 else ("raw", "ours"):
            step = functools.partial(ours.executor.execute_model, 1)
            got[side] = phase(step) if side == "ours" else raw_phase()
        pairs.append((got["ours"], got["raw"]))

    def pooled(chosen: list[tuple[list[float], list[float]]]) -> dict[str, list[float]]:
        return {"ours": [s for p in chosen for s in p[0]], GRAPH: [s for p in chosen for s in p[1]]}

    draw, ratios = random.Random(0), []  # a fixed seed: the same data gives the same interval
    for _ in range(1000):
        again = pooled([draw.choice(pairs) for _ in pairs])
        ratios.append(statistics.median(again["ours"]) / statistics.median(again[GRAPH]))
    ratios.sort()
    note = (
        f"execute_model vs raw compiled graph, {workers} worker(s): 95% interval "
        f"{ratios[25]:.2f}-{ratios[974]:.2f}x (bootstrap over {len(pairs)} phase pairs)"
    )
    return rows("execute_model vs raw compiled graph", workers, pooled(pairs), GRAPH), note


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", action="store_true", help="across two simulated nodes")
    parser.add_argument("--rounds", type=int, default=None, help="default 20, --nodes 10")
    parser.add_argument("--calls", type=int, default=25)
    parser.add_argument("--large-rounds", type=int, default=10, help="rounds of 16 MiB calls")
    parser.add_argument("--large-calls", type=int, default=4, help="16 MiB calls per round")
    parser.add_argument(
        "--phases", type=int, default=20, help="compiled-graph phases per side (0: skip)"
    )
    a = parser.parse_args()
    a.rounds = a.rounds or (10 if a.nodes else 20)
    os.environ[PLUGINS_ENV_VAR] = "ray"  # only the plugin under test, here and in the workers
    env = {PLUGINS_ENV_VAR: "ray"}
    assert sorted(default_registry().plugins) == ["ray"]
    options: dict[str, Any] = {"log_to_driver": False}
    session = RaySession()
    table, notes = [], []
    try:
        if a.nodes:
            session.cluster({"num_cpus": 0}, [{"num_cpus": 4}, {"num_cpus": 4}])
            options["placement_strategy"] = "SPREAD"
        else:
            session.start(4, local_num_cpus=4, log_to_driver=False)
        print(f"ours: tuned, backend_options={options} (the rest at default options)\n")
        for workers in (2,) if a.nodes else (1, 2):
            ours = BackendSide("ray", workers, env=env, options=options)
            spread = {"scheduling_strategy": "SPREAD"} if a.nodes else {}
            raw = RayActorsSide(workers, put_once=False, options={**RAW_ACTOR, **spread})
            try:
                where = (tuple(range(workers)), ()) if not a.nodes else ((), (0, 1))
                assert (ours.executor.ranks_on_rings, ours.executor.ranks_on_hub) == where
                table += calls(ours, raw, workers, a)
                if workers == 2 and not a.nodes:
                    table += large(ours, raw, a)
                if a.phases > 0 and not a.nodes:
                    try:
                        got, note = compiled(ours, raw, workers, a.phases, a.calls)
                    except Exception as exc:  # noqa: BLE001 - the baseline is optional
                        note = f"raw compiled-graph rows skipped: {type(exc).__name__}: {exc}"
                    else:
                        table += got
                    notes.append(note)
            finally:
                raw.close()
                ours.close()
    finally:
        session.close()
    print("\n" + markdown_table(HEADER, table) + "\n")
    print("\n".join(f"* {note}" for note in notes))


if __name__ == "__main__":
    main()
