"""Ray backend across nodes: calls through the channel's hub over TCP against raw Ray.

    .venv/bin/python benchmarks/bench_ray_nodes.py [--rounds 10] [--calls 25]

On a simulated cluster (``ray.cluster_utils.Cluster``: a head node without CPUs, where the
driver runs, and two worker nodes of 4 CPUs; every node on this machine's loopback, so the
network is the kernel's), two workers placed with SPREAD, one per worker node, so that
neither is on the driver's node: both join the driver's hub over authenticated TCP
(``executor.ranks_on_hub == (0, 1)``). Otherwise default options. Against raw Ray:
``ray.get([a.method.remote(...) ...])`` on the same kind of actors, spread alike;

for a no-op ``collective_rpc("get_rank")``, ``execute_model`` back to back and after 30 ms of
sleep, and a 1 MB ``bytes`` argument (each rank returns its length; raw Ray gets the bytes as
a plain argument, and, as a third side, one ``ray.put`` per call with its ref passed to both
actors), the sides interleaved in rounds. Only the plugin under test is loaded
(``EXECUTOR_PLUGINS=ray``; checked at start). Prints median and p99 per call in µs and each
side's ratio to raw Ray's median.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from bench_ray import (
    MB,
    PLUGINS_ENV,
    RawActor,
    check_plugins,
    compare_sides,
    percentile,
)

from executor_core import create_executor
from executor_core.testing import conformance_config
from executor_plugin_ray._executor import RayExecutor

# The tests' cluster set-up (token, temp dir, cleanup of what killed nodes leave behind).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "ray" / "tests"))
from conftest import RaySessions

CPUS_PER_NODE = 4
OURS = "channel (hub over TCP)"
RAW = "raw Ray"


#: The options the runs set (tuned): no output streamed to the driver, one rank per node.
TUNED_OPTIONS = {"log_to_driver": False, "placement_strategy": "SPREAD"}


def _executor() -> RayExecutor:
    executor = create_executor(
        conformance_config(
            "ray",
            world_size=2,
            backend_options=TUNED_OPTIONS,
            env={PLUGINS_ENV: "ray"},
        )
    )
    assert isinstance(executor, RayExecutor)
    driver_node = ray.get_runtime_context().get_node_id()
    nodes = {p.node_id for p in executor.placements}
    assert len(nodes) == 2, "SPREAD put both workers on one node"
    assert driver_node not in nodes, "a worker is on the driver's node"
    assert executor.ranks_on_hub == (0, 1), executor.ranks_on_hub
    assert executor.ranks_on_rings == (), executor.ranks_on_rings
    check_plugins(executor)
    return executor


def _rows(
    case: str, sides: dict[str, Callable[[], Any]], rounds: int, calls: int, pause: float
) -> list[str]:
    samples = compare_sides(sides, rounds, calls, pause)
    raw = statistics.median(samples[RAW])
    return [
        f"| {case} | {name} | {statistics.median(s) * 1e6:,.0f} | "
        f"{percentile(s, 0.99) * 1e6:,.0f} | {statistics.median(s) / raw:.2f}x |"
        for name, s in samples.items()
    ]


def _put_once(actors: list[Any], value: Any) -> list[int]:
    ref = ray.put(value)
    return ray.get([a.payload_size.remote(ref) for a in actors])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=25)
    args = parser.parse_args()
    os.environ[PLUGINS_ENV] = "ray"
    sessions = RaySessions()
    try:
        sessions.cluster(cpus_per_node=CPUS_PER_NODE)
        ours = _executor()
        raw = [RawActor.options(scheduling_strategy="SPREAD").remote(r) for r in range(2)]
        raw_nodes = ray.get([a.__ray_call__.remote(_node_id) for a in raw])
        assert len(set(raw_nodes)) == 2, "SPREAD put both raw actors on one node"
        assert ray.get_runtime_context().get_node_id() not in raw_nodes
        try:
            print(f"ours: tuned, backend_options={TUNED_OPTIONS} (the rest at default options)\n")
            print("| case | side | median µs | p99 µs | ratio to raw Ray |")
            print("|---|---|---|---|---|")
            noop = {
                OURS: functools.partial(ours.collective_rpc, "get_rank"),
                RAW: lambda: ray.get([a.get_rank.remote() for a in raw]),
            }
            step = {
                OURS: functools.partial(ours.execute_model, 1),
                RAW: lambda: ray.get([a.step.remote(1) for a in raw]),
            }
            one_mb = {
                OURS: functools.partial(ours.collective_rpc, "payload_size", args=(MB,)),
                RAW: lambda: ray.get([a.payload_size.remote(MB) for a in raw]),
                "raw Ray, `ray.put` once + refs": functools.partial(_put_once, raw, MB),
            }
            for line in _rows("no-op collective_rpc", noop, args.rounds, args.calls, 0.0):
                print(line, flush=True)
            for line in _rows("execute_model", step, args.rounds, args.calls, 0.0):
                print(line, flush=True)
            idle_rounds, idle_calls = max(2, args.rounds // 2), max(2, args.calls // 2)
            for line in _rows(
                "execute_model after 30 ms idle", step, idle_rounds, idle_calls, 0.03
            ):
                print(line, flush=True)
            for line in _rows("1 MB argument", one_mb, args.rounds, max(1, args.calls // 2), 0.0):
                print(line, flush=True)
        finally:
            for actor in raw:
                ray.kill(actor)
            ours.shutdown()
    finally:
        sessions.close()


def _node_id(actor: Any) -> str:
    return str(ray.get_runtime_context().get_node_id())


if __name__ == "__main__":
    main()
