"""``mp`` across two nodes against raw Ray actor calls across two Ray nodes, side by side.

    .venv/bin/python benchmarks/bench_nodes.py [--noop-calls 300] [--mb-calls 100]
        [--rounds 10] [--warmup 30] [--no-ray-token]

Two "nodes" on this machine over loopback, one rank on each, in one run (``executor bench``'s
worker, sides, Ray session and timing loop):

* ``mp, 2 nodes``: ``executor bench``'s side of its ``nodes`` workload (``TwoNodeSide``):
  ``mp`` with ``num_nodes=2``, rank 0 a worker of this driver, rank 1 one of a node agent on
  127.0.0.2 that it starts; default options but ``node_port``. ``executor bench --workloads
  nodes`` measures it against the two wire baselines below; this script adds raw Ray.
* ``raw Ray, 2 nodes`` (the baseline): a simulated Ray cluster of a head node (this driver's)
  and one more, one plain actor pinned to each by a custom resource; a "collective" is a
  call on each and a ``ray.get`` of both; token authentication unless ``--no-ray-token``.
* ``raw pyzmq over TCP``: a pyzmq PAIR socket over TCP on 127.0.0.2 to each of two spawned
  processes, pickle 5, no authentication: the wire alone (issue 30's first cross-node
  baseline).
* ``vLLM MQ, remote reader`` (with ``--vllm-path DIR``, as ``executor bench`` takes it):
  vLLM's ``MessageQueue`` with rank 0 a local reader and rank 1 a remote one, whose calls
  come over TCP on 127.0.0.2 and whose replies go back through a queue of its own with the
  driver as its remote reader, as vLLM lays out a rank on another node (issue 30's second
  cross-node baseline; no authentication).
* ``mp, 1 node``: ``mp`` with 2 workers on one node, for reference.

A no-op, and a 1 MiB ``bytes`` argument whose length each rank returns (Ray gets the bytes
as a plain argument; an extra row passes one ``ray.put`` ref made once: after the first call
the other node holds a copy, so not the same work). ``--rounds`` interleaved rounds after
``--warmup`` untimed calls each; only the plugin under test is loaded. Median, p99 and each
side's ratio to raw Ray's median (target for ``mp, 2 nodes``: <= 0.5x).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import time
from typing import Any

from executor_bench import (
    BackendSide,
    RayActorsSide,
    RaySession,
    TwoNodeSide,
    VllmQueueSide,
    ZmqSide,
    format_time,
    import_vllm,
    interleave,
    markdown_table,
    percentile,
)

MB = 1 << 20
PAYLOAD = (b"x" * MB,)
RAW = "raw Ray, 2 nodes"
VLLM = "vLLM MQ, remote reader"
#: Seconds after a vLLM block: its local reader spins for a second after each read.
SETTLE_S = 1.2


def rows(case: str, samples: dict[str, list[float]], base: str = RAW) -> list[list[Any]]:
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


def wire_ratio(case: str, samples: dict[str, list[float]]) -> str:
    """``mp, 2 nodes``'s median over the raw pyzmq wire's (issue 30's target: at most 1.5x)
    and over vLLM's remote reader's (at most 0.8x), where it ran."""
    mp = statistics.median(samples["mp, 2 nodes"])
    line = f"{case}: mp, 2 nodes over raw pyzmq over TCP: "
    line += f"{mp / statistics.median(samples['raw pyzmq over TCP']):.2f}x (target <= 1.5x)"
    if VLLM in samples:
        line += f"; over {VLLM}: {mp / statistics.median(samples[VLLM]):.2f}x (target <= 0.8x)"
    return line


def call_options(parser: argparse.ArgumentParser) -> None:
    """The options of the timed calls (``--noop-calls``, ``--mb-calls``, ``--rounds``,
    ``--warmup``)."""
    parser.add_argument("--noop-calls", type=int, default=300, help="timed no-op calls a side")
    parser.add_argument("--mb-calls", type=int, default=100, help="timed 1 MiB calls a side")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    parser.add_argument("--warmup", type=int, default=30, help="untimed calls a side first")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    call_options(parser)
    parser.add_argument("--no-ray-token", action="store_true", help="Ray without token auth")
    parser.add_argument("--vllm-path", help="vLLM's MessageQueue (benchmarks/vllm_mq.sh)")
    args = parser.parse_args()
    os.environ["EXECUTOR_PLUGINS"] = "multiproc"
    started = time.monotonic()
    with contextlib.ExitStack() as stack:  # every callback runs, in reverse order
        # Ray first: its start keeps both cores busy for seconds, which the mp nodes'
        # heartbeats (1 s timeout by default) should not have to ride out.
        session = RaySession()
        stack.callback(session.close)
        pin = [{"num_cpus": 1, "resources": {f"bench_node_{i}": 1}} for i in range(2)]
        session.cluster(pin[0], pin[1:], token=not args.no_ray_token)
        raw = RayActorsSide(2, put_once=False, options=pin)
        stack.callback(raw.close)
        import ray

        nodes = ray.get([actor.node_id.remote() for actor in raw.actors])
        assert nodes[0] == ray.get_runtime_context().get_node_id() != nodes[1], nodes
        two = TwoNodeSide()
        stack.callback(two.close)
        one = BackendSide("mp", 2)
        stack.callback(one.close)
        wire = ZmqSide(2, tcp_host="127.0.0.2")
        stack.callback(wire.close)
        vllm = None
        if args.vllm_path:
            import_vllm(args.vllm_path)
            vllm = VllmQueueSide(2, own_replies=True, remote_ranks=(1,), remote_ip="127.0.0.2")
            stack.callback(vllm.close)
        assert two.call("size_of", PAYLOAD) == raw.call("size_of", PAYLOAD) == [MB, MB]
        ref = (ray.put(PAYLOAD[0]),)
        print(
            f"cores: {os.cpu_count()}; Ray token auth: {not args.no_ray_token}; set-up "
            f"{time.monotonic() - started:.1f} s\n"
        )
        time.sleep(1.0)  # let Ray's and the agent's start-up work settle
        noop = {
            "mp, 2 nodes": two,
            RAW: raw,
            "raw pyzmq over TCP": wire,
            "mp, 1 node (reference)": one,
        }
        if vllm is not None:
            noop[VLLM] = vllm
        # vLLM's local reader spins for a second after each read: let it stop first.
        settle = {VLLM: SETTLE_S}
        samples = interleave(
            {name: functools.partial(side.call, "noop", ()) for name, side in noop.items()},
            args.rounds,
            max(1, args.noop_calls // args.rounds),
            warmup=args.warmup,
            settle_s=settle,
        )
        table = rows("no-op collective_rpc", samples)
        over_wire = [wire_ratio("no-op", samples)]
        one_mb = {
            name: functools.partial(side.call, "size_of", PAYLOAD) for name, side in noop.items()
        }
        one_mb["raw Ray, ray.put once, ref passed"] = functools.partial(raw.call, "size_of", ref)
        samples = interleave(
            one_mb,
            args.rounds,
            max(1, args.mb_calls // args.rounds),
            warmup=max(1, args.warmup // 3),
            settle_s=settle,
        )
        table += rows("1 MiB bytes argument, each rank returns len()", samples)
        over_wire.append(wire_ratio("1 MiB", samples))
        del ref  # before Ray shuts down
    print(markdown_table(["case", "side", "calls", "median", "p99", "ratio to raw Ray"], table))
    print("\n".join(over_wire))
    print(f"total {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
