"""How often this machine takes a core away from a running process, and for how long.

    .venv/bin/python benchmarks/machine_noise.py [--seconds 2] [--gap-us 20]

Pinned to each CPU in turn, one process reads the clock in a tight loop for ``--seconds`` and
records every gap longer than ``--gap-us`` between two reads: a time the process was not
running (an interrupt, the hypervisor, another process). Nothing else of the SDK runs.

This bounds the tail of any call that keeps processes running on every core: a call whose
critical path spans ``T`` µs on a core meets a gap with a probability of about
``rate * (T + mean gap)`` per core, and then takes the gap's length longer. It is what sets
the p99 of a no-op round trip of tens of µs on a small VM (see docs/benchmarks.md, ``executor
bench``): a machine figure, not a result of this code.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def gaps(seconds: float, threshold_s: float) -> list[float]:
    """The gaps longer than ``threshold_s`` seen while reading the clock for ``seconds``."""
    clock = time.perf_counter
    found = []
    last = clock()
    end = last + seconds
    while last < end:
        now = clock()
        if now - last > threshold_s:
            found.append(now - last)
        last = now
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--gap-us", type=float, default=20.0)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    print(
        f"gaps over {args.gap_us:g} µs while reading the clock, {args.seconds:g} s per CPU "
        f"(load average {os.getloadavg()[0]:.2f})"
    )
    heads = ("cpu", 4), ("gaps/s", 8), ("mean µs", 8), ("p50 µs", 7), ("p90 µs", 7)
    print(" ".join(f"{name:>{width}}" for name, width in heads), f"{'max µs':>8} {'lost':>6}")
    try:
        for cpu in cpus:
            os.sched_setaffinity(0, {cpu})
            found = sorted(g * 1e6 for g in gaps(args.seconds, args.gap_us * 1e-6))
            if not found:
                print(f"{cpu:>4} {0:>8.0f}")
                continue
            print(
                f"{cpu:>4} {len(found) / args.seconds:>8.0f} {statistics.fmean(found):>8.1f} "
                f"{found[len(found) // 2]:>7.0f} {found[int(0.9 * len(found))]:>7.0f} "
                f"{found[-1]:>8.0f} {sum(found) / args.seconds / 1e4:>5.2f}%"
            )
    finally:
        os.sched_setaffinity(0, set(cpus))


if __name__ == "__main__":
    main()
