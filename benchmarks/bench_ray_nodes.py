"""Ray backend across nodes: direct calls over TCP against Ray actor calls and raw Ray.

    .venv/bin/python benchmarks/bench_ray_nodes.py [--rounds 10] [--calls 25]

On a simulated cluster (``ray.cluster_utils.Cluster``: a head node without CPUs, where the
driver runs, and two worker nodes of 4 CPUs; every node on this machine's loopback, so the
network is the kernel's), two workers placed with SPREAD, one per worker node, so that
neither is on the driver's node:

* ``direct_calls_across_nodes=True``: calls on the executor's TCP sockets;
* the default: Ray actor calls;
* raw Ray: ``ray.get([a.get_rank.remote() ...])`` on the same kind of actors, spread alike;

for a no-op ``collective_rpc("get_rank")`` and ``execute_model``, back to back and after
30 ms of sleep, the three sides interleaved in rounds. Only the plugin under test is loaded
(``EXECUTOR_PLUGINS=ray``). Prints median and p99 per call in µs and each side's ratio to
raw Ray's median.
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
from bench_ray import PLUGINS_ENV, RawActor, percentile, timed

from executor_core import create_executor
from executor_core.testing import conformance_config
from executor_plugin_ray._executor import RayExecutor

# The tests' cluster set-up (token, temp dir, cleanup of what killed nodes leave behind).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "ray" / "tests"))
from conftest import RaySessions

CPUS_PER_NODE = 4


def _executor(across_nodes: bool) -> RayExecutor:
    executor = create_executor(
        conformance_config(
            "ray",
            world_size=2,
            backend_options={
                "log_to_driver": False,
                "placement_strategy": "SPREAD",
                "direct_calls_across_nodes": across_nodes,
            },
            env={PLUGINS_ENV: "ray"},
        )
    )
    assert isinstance(executor, RayExecutor)
    assert executor.uses_direct_calls == across_nodes
    driver_node = ray.get_runtime_context().get_node_id()
    nodes = {p.node_id for p in executor.placements}
    assert len(nodes) == 2, "SPREAD put both workers on one node"
    assert driver_node not in nodes, "a worker is on the driver's node"
    return executor


def _rows(
    case: str, sides: dict[str, Callable[[], Any]], rounds: int, calls: int, pause: float
) -> list[str]:
    for call in sides.values():  # warm-up, not measured
        for _ in range(calls):
            call()
    samples: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for i in range(rounds):
        shift = i % len(names)  # rotate which side goes first
        for name in names[shift:] + names[:shift]:
            timed(sides[name], calls, samples[name], pause)
    raw = statistics.median(samples["raw Ray"])
    return [
        f"| {case} | {name} | {statistics.median(s) * 1e6:,.0f} | "
        f"{percentile(s, 0.99) * 1e6:,.0f} | {statistics.median(s) / raw:.2f}x |"
        for name, s in samples.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=25)
    args = parser.parse_args()
    os.environ[PLUGINS_ENV] = "ray"
    sessions = RaySessions()
    try:
        sessions.cluster(cpus_per_node=CPUS_PER_NODE)
        direct = _executor(across_nodes=True)
        actor_calls = _executor(across_nodes=False)
        raw = [RawActor.options(scheduling_strategy="SPREAD").remote(r) for r in range(2)]
        ray.get([a.get_rank.remote() for a in raw])
        try:
            print("| case | side | median µs | p99 µs | ratio to raw Ray |")
            print("|---|---|---|---|---|")
            noop = {
                "direct over TCP": functools.partial(direct.collective_rpc, "get_rank"),
                "actor calls": functools.partial(actor_calls.collective_rpc, "get_rank"),
                "raw Ray": lambda: ray.get([a.get_rank.remote() for a in raw]),
            }
            step = {
                "direct over TCP": functools.partial(direct.execute_model, 1),
                "actor calls": functools.partial(actor_calls.execute_model, 1),
                "raw Ray": lambda: ray.get([a.step.remote(1) for a in raw]),
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
        finally:
            for actor in raw:
                ray.kill(actor)
            direct.shutdown()
            actor_calls.shutdown()
    finally:
        sessions.close()


if __name__ == "__main__":
    main()
