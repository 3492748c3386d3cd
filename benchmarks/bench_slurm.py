"""``slurm`` across two Slurm nodes beside ``mp`` across two nodes, in one run.

    .venv/bin/python benchmarks/bench_slurm.py [--starts 5] [--noop-calls 300]
        [--mb-calls 100] [--rounds 10] [--warmup 30]

Run as root with Slurm installed: with no ``SLURM_CONF`` set, it starts the tests' cluster
(``plugins/slurm/tests/slurm_cluster.py``: munged, slurmctld, two slurmd ``n1`` and ``n2``
on this machine) and takes it down at the end. Default options throughout; one rank on each
node; ``executor bench``'s worker, sides and timing loop. Both topologies are measured: the
driver on node 0 holding its rank (``slurm`` in a batch script, emulated by
``SLURMD_NODENAME=n1``, beside ``mp`` with ``num_nodes=2`` and a node-1 agent this script
starts) and the driver on no node (``slurm`` from a salloc shell or a login node, beside the
``cluster`` example, whose two agents are local processes). Every agent runs in a session of
its own, as slurmstepd's tasks do: on one machine the kernel shares the CPUs between
sessions (autogroups), which moves a round trip, so the baselines need the same. The rows:

* create to first call returned, and ``shutdown()``: ``--starts`` executors each (``mp``'s
  agent is started just before ``create_executor``; from a login node ``slurm`` adds a salloc
  and the job's release);
* a no-op and a 1 MiB ``bytes`` argument (each rank returns its length) through
  ``collective_rpc``, ``--rounds`` interleaved rounds after ``--warmup`` untimed calls, with
  the ratio to ``mp, 2 nodes``. The channel is ``mp``'s on every side: ``slurm`` should be
  within 1.1x of the side of its topology.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from executor_bench import BackendSide, format_time, interleave, markdown_table, percentile
from executor_channel import Secret
from executor_core.backend import find_free_port

MB = 1 << 20
PAYLOAD = (b"x" * MB,)
MP = "mp, 2 nodes"
TESTS = Path(__file__).resolve().parents[1] / "plugins" / "slurm" / "tests"


def rows(case: str, samples: dict[str, list[float]], base: str) -> list[list[Any]]:
    """One row per side: its calls, median, p99 and ratio to ``base``'s median."""
    raw = statistics.median(samples[base])
    return [
        [
            case,
            name,
            len(s),
            format_time(statistics.median(s)),
            format_time(percentile(s, 0.99)),
            f"{statistics.median(s) / raw:.2f}x",
        ]
        for name, s in samples.items()
    ]


def call_options(parser: argparse.ArgumentParser) -> None:
    """The options of the timed calls."""
    parser.add_argument("--noop-calls", type=int, default=300, help="timed no-op calls a side")
    parser.add_argument("--mb-calls", type=int, default=100, help="timed 1 MiB calls a side")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    parser.add_argument("--warmup", type=int, default=30, help="untimed calls a side first")


def start_agent(port: int, log: Any, session: bool = False) -> subprocess.Popen[bytes]:
    """The node agent of node rank 1 (its workers import what this process can); in a
    session of its own with ``session``, as a scheduler's step is (on one machine the
    kernel's autogroups then share the CPUs between the driver's session and the agent's,
    which changes a round trip's latency: a like-for-like baseline needs the same)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    command = [sys.executable, "-m", "executor_core", "node", "--node-rank", "1"]
    command += ["--master-addr", "127.0.0.1", "--master-port", str(port), "--join-timeout", "60"]
    return subprocess.Popen(
        command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=session
    )


@contextlib.contextmanager
def slurm_cluster() -> Iterator[str]:
    """``SLURM_CONF`` of the cluster to use: the environment's, else the tests' one."""
    if os.environ.get("SLURM_CONF"):
        yield os.environ["SLURM_CONF"]
        return
    sys.path.insert(0, str(TESTS))
    from slurm_cluster import SlurmCluster, cannot_run

    reason = cannot_run()
    if reason is not None:
        raise SystemExit(f"bench_slurm: {reason}")
    cluster = SlurmCluster()
    os.environ["SLURM_CONF"] = str(cluster.conf)
    try:
        cluster.start()
        yield str(cluster.conf)
    finally:
        cluster.stop()
        del os.environ["SLURM_CONF"]


@contextlib.contextmanager
def on_node(node: str) -> Iterator[None]:
    """As a batch script or an srun step of the job on ``node`` is (the nodes are all this
    machine): the driver runs that node's rank."""
    os.environ["SLURMD_NODENAME"] = node
    try:
        yield
    finally:
        del os.environ["SLURMD_NODENAME"]


@contextlib.contextmanager
def allocation() -> Iterator[str]:
    """Inside a job of two nodes, as a salloc shell is (this process on neither node)."""
    out = subprocess.run(
        ["salloc", "--no-shell", "--nodes=2", "--job-name=bench"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    job = out.stderr.split("Granted job allocation")[1].split()[0]
    os.environ.update(SLURM_JOB_ID=job, SLURM_JOB_NODELIST="n[1-2]")
    try:
        yield job
    finally:
        del os.environ["SLURM_JOB_ID"], os.environ["SLURM_JOB_NODELIST"]
        subprocess.run(["scancel", job], check=True, timeout=60)


@contextlib.contextmanager
def no_job() -> Iterator[None]:
    """Outside any job, as on a login node."""
    saved = {name: os.environ.pop(name) for name in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST")}
    try:
        yield
    finally:
        os.environ.update(saved)


def start_and_stop(make: Callable[[], tuple[BackendSide, Any]], starts: int) -> list[list[float]]:
    """``starts`` times: create to first call returned, and shutdown (seconds)."""
    created, stopped = [], []
    for _ in range(starts):
        begin = time.perf_counter()
        side, extra = make()
        side.call("noop", ())
        created.append(time.perf_counter() - begin)
        begin = time.perf_counter()
        side.close()
        if extra is not None:  # mp's agent: it exits once told to stop
            extra.wait(30)
        stopped.append(time.perf_counter() - begin)
    return [created, stopped]


def make_slurm() -> tuple[BackendSide, Any]:
    return BackendSide("slurm", 2, num_nodes=2), None


def make_cluster() -> tuple[BackendSide, Any]:
    return BackendSide("cluster", 2, num_nodes=2), None


def make_mp() -> tuple[BackendSide, Any]:
    port = find_free_port()
    agent = start_agent(port, subprocess.DEVNULL, session=True)
    return BackendSide("mp", 2, options={"node_port": port}, num_nodes=2), agent


def summary(samples: list[float]) -> str:
    return f"{format_time(statistics.median(samples))} (min {format_time(min(samples))})"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--starts", type=int, default=5, help="executors created per side")
    call_options(parser)
    args = parser.parse_args()
    os.environ["EXECUTOR_PLUGINS"] = "multiproc,slurm,cluster"
    os.environ[Secret.ENV] = secrets.token_hex(32)  # mp's agents; slurm makes its own
    started = time.monotonic()
    with slurm_cluster(), allocation(), contextlib.ExitStack() as stack:
        lifecycle = {
            "slurm, within the job, driver off its nodes (2 steps)": start_and_stop(
                make_slurm, args.starts
            ),
        }
        with on_node("n1"):
            lifecycle["slurm, within the job, driver on n1 (1 step)"] = start_and_stop(
                make_slurm, args.starts
            )
        lifecycle[MP] = start_and_stop(make_mp, args.starts)
        lifecycle["cluster (2 local agent processes)"] = start_and_stop(make_cluster, args.starts)
        with no_job():
            lifecycle["slurm, from a login node (salloc + 2 steps)"] = start_and_stop(
                make_slurm, args.starts
            )
        with on_node("n1"):
            near = BackendSide("slurm", 2, num_nodes=2)
        stack.callback(near.close)
        far = BackendSide("slurm", 2, num_nodes=2)
        stack.callback(far.close)
        cluster = BackendSide("cluster", 2, num_nodes=2)
        stack.callback(cluster.close)
        port = find_free_port()
        agent = start_agent(port, subprocess.DEVNULL, session=True)
        stack.callback(agent.wait, 30)
        two = BackendSide("mp", 2, options={"node_port": port}, num_nodes=2)
        stack.callback(two.close)
        sides = {
            "slurm, driver on n1 + agent on n2": near,
            MP: two,
            "slurm, driver off the nodes, 2 agents": far,
            "cluster, driver off the nodes, 2 agents": cluster,
        }
        for side in sides.values():
            assert side.call("size_of", PAYLOAD) == [MB, MB]
        time.sleep(1.0)  # the agents' start-up work settles
        noop = {name: functools.partial(side.call, "noop", ()) for name, side in sides.items()}
        one_mb = {
            name: functools.partial(side.call, "size_of", PAYLOAD) for name, side in sides.items()
        }
        samples = interleave(
            noop, args.rounds, max(1, args.noop_calls // args.rounds), warmup=args.warmup
        )
        table = rows("no-op collective_rpc", samples, MP)
        samples = interleave(
            one_mb,
            args.rounds,
            max(1, args.mb_calls // args.rounds),
            warmup=max(1, args.warmup // 3),
        )
        table += rows("1 MiB bytes argument, each rank returns len()", samples, MP)
    print(f"cores: {os.cpu_count()}; {args.starts} executors per side\n")
    print(
        markdown_table(
            ["side", "create to first call (median)", "shutdown (median)"],
            [[name, summary(c), summary(s)] for name, (c, s) in lifecycle.items()],
        )
    )
    print()
    print(markdown_table(["case", "side", "calls", "median", "p99", "ratio to mp, 2 nodes"], table))
    print(f"total {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
