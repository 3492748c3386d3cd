"""``mp`` across two nodes against raw Ray actor calls across two Ray nodes, side by side.

    .venv/bin/python benchmarks/bench_nodes.py [--noop-calls 300] [--mb-calls 100]
        [--rounds 10] [--warmup 30] [--no-ray-token]

Two "nodes" on this machine, linked over loopback TCP, one rank on each, in one run:

* ``mp, 2 nodes``: the ``mp`` executor with ``num_nodes=2``, ``world_size=2``: rank 0 is a
  worker of this driver, rank 1 a worker of a node agent (``python -m executor_core node
  --node-rank 1``) started by this script with the shared ``EXECUTOR_CHANNEL_SECRET``.
  Default backend options except ``node_port``.
* ``raw Ray, 2 nodes`` (the baseline): a ``ray.cluster_utils.Cluster`` of a head node (where
  this driver runs) and one more node, one plain actor on each (a custom resource per node
  pins them), and a "collective" is ``ray.get([a.method.remote(...) for a in actors])``.
  With Ray token authentication, as the project's tests start clusters (``--no-ray-token``:
  without).
* ``mp, 1 node``: the ``mp`` executor with ``world_size=2`` on one node, for reference.

Workloads: a no-op method, and a 1 MiB ``bytes`` argument whose length each rank returns
(so only the argument travels; the reply is an int). Ray gets the bytes as a plain argument,
as a user passes them (Ray puts an argument over 100 KiB into its object store per call);
a labelled extra row passes one ``ray.put`` ref made once (after the first call the other
node holds a copy, so the MiB no longer crosses: not the same work, shown for scale).

The sides are interleaved in ``--rounds`` rounds (which side goes first rotates), so that
load from other processes on the machine hits them alike, after ``--warmup`` untimed calls
each. Only the plugin under test is loaded (``EXECUTOR_PLUGINS=multiproc``). Prints median
and p99 per call and each side's ratio to raw Ray's median (target for ``mp, 2 nodes``:
<= 0.5x).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import operator
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from bench_multiproc import BenchWorker, percentile

from executor_channel import ENV_SECRET
from executor_core import Executor, ExecutorConfig, create_executor
from executor_core.backend import find_free_port

MB = 1 << 20
PAYLOAD = b"x" * MB
PLUGINS_ENV = "EXECUTOR_PLUGINS"
SHM_DIR = "/dev/shm"
#: The custom resource that pins the baseline's actor ``i`` to Ray node ``i``.
NODE_RESOURCE = "bench_node_{}"


class Echo:
    """The baseline's actor (wrapped with ``ray.remote`` once Ray is imported): the same
    methods as :class:`~bench_multiproc.BenchWorker`, with nothing in between."""

    def noop(self) -> None:
        return None

    def size(self, data: bytes) -> int:
        return len(data)

    def node(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())


# --- the two sides -----------------------------------------------------------------------


class RayNodes:
    """A simulated two-node Ray cluster with one actor per node (set up as the project's
    tests do: a private temp dir, token authentication, orphan semaphores removed)."""

    def __init__(self, token: bool) -> None:
        self.token = token
        self.cluster: Any = None
        self.actors: list[Any] = []
        self._tmp: str | None = None
        self._saved_env: dict[str, str | None] = {}

    def start(self) -> None:
        import ray
        from ray.cluster_utils import Cluster

        # A short path: Ray's socket paths under it must stay within 107 bytes.
        self._tmp = tempfile.mkdtemp(prefix="executor-bench-nodes-")
        os.makedirs(os.path.join(self._tmp, "ray"))
        self._set_env("RAY_TMPDIR", self._tmp)
        if self.token:
            from ray._private.authentication.authentication_token_setup import (
                _enable_token_auth,
            )

            from executor_plugin_ray import _cluster

            self._set_env("RAY_AUTH_MODE", "token")
            self._set_env("RAY_AUTH_TOKEN", _cluster._process_token)
            _enable_token_auth()
            _cluster._reset_token_cache()
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 1,
                "resources": {NODE_RESOURCE.format(0): 1},
                "include_dashboard": False,
            },
        )
        self.cluster.add_node(num_cpus=1, resources={NODE_RESOURCE.format(1): 1})
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, log_to_driver=False, logging_level=logging.WARNING)
        actor_cls = ray.remote(num_cpus=1)(Echo)
        self.actors = [
            actor_cls.options(resources={NODE_RESOURCE.format(i): 1}).remote() for i in range(2)
        ]
        nodes = ray.get([a.node.remote() for a in self.actors])
        driver = ray.get_runtime_context().get_node_id()
        assert nodes[0] == driver != nodes[1], f"actors not one per node: {nodes}, {driver}"

    def close(self) -> None:
        import ray

        from executor_plugin_ray._reaper import remove_orphan_semaphores

        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        self.actors = []
        cluster, self.cluster = self.cluster, None
        if cluster is not None:
            pids = [
                info.process.pid
                for node in cluster.list_all_nodes()
                for infos in node.all_processes.values()
                for info in infos
                if info.process is not None
            ]
            ray.shutdown()
            cluster.shutdown()
            # Killed nodes' object stores leave their semaphores in /dev/shm.
            remove_orphan_semaphores(pids, wait_s=10.0)
        elif ray.is_initialized():
            ray.shutdown()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        for name, value in self._saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._saved_env.clear()
        if self.token:
            from executor_plugin_ray import _cluster

            _cluster._reset_token_cache()

    def _set_env(self, name: str, value: str) -> None:
        self._saved_env.setdefault(name, os.environ.get(name))
        os.environ[name] = value


class Agent:
    """The node agent of node rank 1: a child process, waited for and, if need be, killed."""

    def __init__(self, port: int) -> None:
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in stop())
        env = {
            **os.environ,
            # The agent's workers import BenchWorker from this directory.
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        }
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "executor_core",
                "node",
                "--node-rank",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "--join-timeout",
                "60",
            ],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def stop(self) -> str:
        """Wait for the agent to exit (the executor's shutdown stops it), else kill it by its
        pid; return how it ended."""
        how = "exited"
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            how = "killed after 10 s"
            self.proc.kill()
            self.proc.wait(10)
        code = self.proc.returncode
        if code != 0:
            self.log.seek(0)
            tail = self.log.read().decode(errors="replace")[-2000:]
            print(f"agent (pid {self.proc.pid}) output:\n{tail}", file=sys.stderr)
        self.log.close()
        return f"agent pid {self.proc.pid} {how} with code {code}"


def mp_executor(num_nodes: int, port: int | None = None) -> Executor:
    options = {} if port is None else {"node_port": port}
    return create_executor(
        ExecutorConfig(
            worker_cls=BenchWorker,
            backend="mp",
            tensor_parallel_size=2,
            num_nodes=num_nodes,
            backend_options=options,
        )
    )


# --- measuring ---------------------------------------------------------------------------


def measure(
    sides: dict[str, Callable[[], Any]], rounds: int, calls: int, warmup: int
) -> dict[str, list[float]]:
    for call in sides.values():  # warm-up, not measured
        for _ in range(warmup):
            call()
    samples: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    per_round = max(1, calls // rounds)
    for i in range(rounds):
        shift = i % len(names)  # rotate which side goes first
        for name in names[shift:] + names[:shift]:
            call, out = sides[name], samples[name]
            for _ in range(per_round):
                start = time.perf_counter()
                call()
                out.append(time.perf_counter() - start)
    return samples


def fmt(seconds: float) -> str:
    if seconds >= 1e-3:
        return f"{seconds * 1e3:,.2f} ms"
    return f"{seconds * 1e6:,.0f} µs"


def rows(case: str, samples: dict[str, list[float]]) -> list[str]:
    raw = statistics.median(samples["raw Ray, 2 nodes"])
    return [
        f"| {case} | {name} | {len(s)} | {fmt(statistics.median(s))} | "
        f"{fmt(percentile(s, 0.99))} | {statistics.median(s) / raw:.2f}x |"
        for name, s in samples.items()
    ]


def shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except OSError:
        return set()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--noop-calls", type=int, default=300, help="timed no-op calls a side")
    parser.add_argument("--mb-calls", type=int, default=100, help="timed 1 MiB calls a side")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    parser.add_argument("--warmup", type=int, default=30, help="untimed calls a side first")
    parser.add_argument(
        "--no-ray-token", action="store_true", help="start Ray without token authentication"
    )
    args = parser.parse_args()
    os.environ[PLUGINS_ENV] = "multiproc"
    os.environ[ENV_SECRET] = secrets.token_hex(32)
    shm_before = shm_entries()
    started = time.monotonic()
    ended: list[str] = []
    with contextlib.ExitStack() as cleanup:  # every callback runs, in reverse order
        # Ray first: its start keeps both cores busy for seconds, which the mp nodes'
        # heartbeats (1 s timeout by default) should not have to ride out.
        import ray

        ray_nodes = RayNodes(token=not args.no_ray_token)
        cleanup.callback(ray_nodes.close)
        ray_nodes.start()
        actors = ray_nodes.actors

        port = find_free_port()
        agent = Agent(port)
        cleanup.callback(lambda: ended.append(agent.stop()))
        two_nodes = mp_executor(2, port)
        cleanup.callback(two_nodes.shutdown)
        one_node = mp_executor(1)
        cleanup.callback(one_node.shutdown)

        contexts = two_nodes.collective_rpc(operator.attrgetter("context"))
        assert [c.rank for c in contexts] == [0, 1]
        assert contexts[0].node_id != contexts[1].node_id, "both mp ranks on one node"
        nodes = one_node.collective_rpc(operator.attrgetter("context.node_id"))
        assert nodes[0] == nodes[1]
        assert two_nodes.collective_rpc("size", args=(PAYLOAD,)) == [MB, MB]
        assert ray.get([a.size.remote(PAYLOAD) for a in actors]) == [MB, MB]
        put_refs = [ray.put(PAYLOAD)]  # dropped before Ray shuts down
        cleanup.callback(put_refs.clear)
        setup_s = time.monotonic() - started
        time.sleep(1.0)  # let Ray's and the agent's start-up work settle

        print(
            f"cores: {os.cpu_count()}; mp nodes: {contexts[0].node_id} (driver) and "
            f"{contexts[1].node_id} (agent); Ray token auth: {not args.no_ray_token}; "
            f"set-up {setup_s:.1f} s"
        )
        print("ratio = side's median / raw Ray (2 nodes) median; target for mp, 2 nodes <= 0.5x")
        print()
        print("| case | side | calls | median | p99 | ratio to raw Ray |")
        print("|---|---|---|---|---|---|")
        noop = measure(
            {
                "mp, 2 nodes": lambda: two_nodes.collective_rpc("noop"),
                "raw Ray, 2 nodes": lambda: ray.get([a.noop.remote() for a in actors]),
                "mp, 1 node (reference)": lambda: one_node.collective_rpc("noop"),
            },
            args.rounds,
            args.noop_calls,
            args.warmup,
        )
        for line in rows("no-op collective_rpc", noop):
            print(line, flush=True)
        payload = measure(
            {
                "mp, 2 nodes": lambda: two_nodes.collective_rpc("size", args=(PAYLOAD,)),
                "raw Ray, 2 nodes": lambda: ray.get([a.size.remote(PAYLOAD) for a in actors]),
                "raw Ray, ray.put once, ref passed": lambda: ray.get(
                    [a.size.remote(put_refs[0]) for a in actors]
                ),
                "mp, 1 node (reference)": lambda: one_node.collective_rpc("size", args=(PAYLOAD,)),
            },
            args.rounds,
            args.mb_calls,
            max(1, args.warmup // 3),
        )
        for line in rows("1 MiB bytes argument, each rank returns len()", payload):
            print(line, flush=True)
        ratio_noop = statistics.median(noop["mp, 2 nodes"]) / statistics.median(
            noop["raw Ray, 2 nodes"]
        )
        ratio_mb = statistics.median(payload["mp, 2 nodes"]) / statistics.median(
            payload["raw Ray, 2 nodes"]
        )
        print(
            f"\nmp, 2 nodes / raw Ray, 2 nodes (medians): no-op {ratio_noop:.2f}x, "
            f"1 MiB {ratio_mb:.2f}x (target <= 0.5x)"
        )
    for line in ended:
        print(line)
    leftovers = sorted(shm_entries() - shm_before)
    print(
        f"new entries in {SHM_DIR} after clean-up: {leftovers or 'none'}; "
        f"total {time.monotonic() - started:.1f} s"
    )


if __name__ == "__main__":
    main()
