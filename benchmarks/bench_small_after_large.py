"""Small calls right after large ones, against small calls after small ones, at default options.

    .venv/bin/python benchmarks/bench_small_after_large.py [--workers 2]
        [--large-mib 64] [--large-calls 3] [--calls 200] [--rounds 10]

An engine sends a large argument now and then (weights, a KV-cache block, a batch of images)
between many small calls. While a large message moves, the driver and the workers copy it
for milliseconds and take each other's CPU, so their spins lose the CPU; this must not leave
them sleeping through the small calls that follow (see ``executor_channel._spin``).

Two executors run side by side, each with its own workers, and take turns each round:

* ``after large``: ``--large-calls`` calls whose argument is ``--large-mib`` MiB of
  ``bytes`` (untimed), then ``--calls`` timed no-op ``collective_rpc`` calls;
* ``small only``: the baseline, an executor that never sees a large call: as many untimed
  no-op calls, then ``--calls`` timed ones.

Reported per executor: median, p90 and p99 of the timed no-op calls in µs, and each over the
baseline's. The first call of each block is timed like the others: it is the one that meets
whatever the large calls left behind.

On mp: the ray backend's workers on the driver's node use the same rings and waits, but two
ray executors of 2 workers do not fit the 2 CPUs of a small machine at default options.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from executor_core import ExecutorConfig, WorkerBase, create_executor

MIB = 1 << 20


class Worker(WorkerBase):
    def noop(self) -> None:
        return None

    def size_of(self, payload: bytes) -> int:
        return len(payload)


def quantile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--large-mib", type=int, default=64)
    parser.add_argument("--large-calls", type=int, default=3)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    os.environ.setdefault("EXECUTOR_PLUGINS", "multiproc")  # only the backend under test

    large = os.urandom(args.large_mib * MIB)
    names = ["after large", "small only"]
    samples: dict[str, list[float]] = {name: [] for name in names}
    config = ExecutorConfig(worker_cls=Worker, backend="mp", tensor_parallel_size=args.workers)
    executors = {}
    clock = time.perf_counter
    try:
        for name in names:
            executors[name] = create_executor(config)
        for _ in range(2):  # warm-up: rings, receive caches and heaps
            executors["after large"].collective_rpc("size_of", args=(large,))
        for executor in executors.values():
            for _ in range(200):
                executor.collective_rpc("noop")
        for turn in range(args.rounds):
            for name in names if turn % 2 == 0 else names[::-1]:
                executor = executors[name]
                for _ in range(args.large_calls):
                    if name == "after large":
                        executor.collective_rpc("size_of", args=(large,))
                    else:
                        executor.collective_rpc("noop")
                out = samples[name]
                for _ in range(args.calls):
                    start = clock()
                    executor.collective_rpc("noop")
                    out.append(clock() - start)
    finally:
        for executor in executors.values():
            executor.shutdown()

    base = samples["small only"]
    print(
        f"mp, {args.workers} workers, default options: no-op calls after "
        f"{args.large_calls} calls of {args.large_mib} MiB, against an executor that only gets "
        f"no-ops ({args.rounds} rounds of {args.calls} calls each)"
    )
    print(f"{'executor':<12} {'median µs':>10} {'p90 µs':>8} {'p99 µs':>8}   vs small only")
    for name, got in samples.items():
        stats = [statistics.median(got), quantile(got, 0.9), quantile(got, 0.99)]
        ref = [statistics.median(base), quantile(base, 0.9), quantile(base, 0.99)]
        ratios = " / ".join(f"{s / r:.2f}" for s, r in zip(stats, ref, strict=True))
        print(
            f"{name:<12} {stats[0] * 1e6:>10.1f} {stats[1] * 1e6:>8.1f} {stats[2] * 1e6:>8.1f}"
            f"   {ratios}"
        )


if __name__ == "__main__":
    main()
