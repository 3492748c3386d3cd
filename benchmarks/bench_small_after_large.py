"""Small calls right after large ones, against small calls after small ones (default options).

    .venv/bin/python benchmarks/bench_small_after_large.py [--workers 2]
        [--large-mib 64] [--large-calls 3] [--calls 200] [--rounds 10]

While a large message moves, the driver and the workers copy it for milliseconds and take
each other's CPU, so their spins lose the CPU; this must not leave them sleeping through the
small calls that follow (``executor_channel._spin``). Two ``mp`` executors (``executor
bench``'s side) take turns each round: ``after large`` gets ``--large-calls`` calls of
``--large-mib`` MiB of ``bytes`` (untimed), then ``--calls`` timed no-ops; ``small only``, the
baseline, as many untimed no-ops, then as many timed ones. Reported: median, p90 and p99 of
the timed no-ops, and each over the baseline's; the first call of a block is timed too.
(Two ray executors of 2 workers do not fit the 2 CPUs of a small machine.)
"""

from __future__ import annotations

import argparse
import os
import statistics

from executor_bench import BackendSide, interleave, markdown_table, percentile

MIB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--large-mib", type=int, default=64)
    parser.add_argument("--large-calls", type=int, default=3)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    os.environ.setdefault("EXECUTOR_PLUGINS", "multiproc")  # only the backend under test
    large = (os.urandom(args.large_mib * MIB),)
    after, small = BackendSide("mp", args.workers), BackendSide("mp", args.workers)
    try:
        for _ in range(2):  # warm-up: rings, receive caches and heaps
            after.call("size_of", large)
        for _ in range(200):
            after.call("noop", ())
            small.call("noop", ())

        def block(side: BackendSide, method: str, args_: tuple[bytes, ...]) -> list[float]:
            for _ in range(args.large_calls):
                side.call(method, args_)
            return interleave({"": lambda: side.call("noop", ())}, 1, args.calls)[""]

        samples: dict[str, list[float]] = {"after large": [], "small only": []}
        for turn in range(args.rounds):
            for name in list(samples)[:: 1 if turn % 2 == 0 else -1]:
                blocks = (after, "size_of", large) if name == "after large" else (small, "noop", ())
                samples[name] += block(*blocks)
    finally:
        after.close()
        small.close()
    stats = {
        name: [statistics.median(got), percentile(got, 0.9), percentile(got, 0.99)]
        for name, got in samples.items()
    }
    base = stats["small only"]
    print(
        f"mp, {args.workers} workers, default options: no-op calls after {args.large_calls} "
        f"calls of {args.large_mib} MiB, against an executor that only gets no-ops "
        f"({args.rounds} rounds of {args.calls} calls each)\n"
    )
    rows = [
        [
            name,
            *(f"{s * 1e6:.1f}" for s in got),
            " / ".join(f"{s / b:.2f}" for s, b in zip(got, base, strict=True)),
        ]
        for name, got in stats.items()
    ]
    print(markdown_table(["executor", "median µs", "p90 µs", "p99 µs", "vs small only"], rows))


if __name__ == "__main__":
    main()
