"""Payload sweep: the cost per byte of a call's argument, by size (default options).

    .venv/bin/python benchmarks/bench_payload_sweep.py [--backend mp|ray] [--workers 2]
        [--sizes-kib 4 ... 131072] [--kind tensor|bytes] [--repeats 9] [--blocks 3] [--slot-mib N]

Each call sends one argument (a CPU float32 tensor, or ``bytes``) to every worker, which
returns its size (``executor bench``'s worker, side and timing loop); the sizes take turns in
``--blocks`` blocks. The ring's slots are 16 MiB at default options. Per size: the median µs
per call, µs per MiB, and that over the cost per MiB of the largest size that fits one slot
(``vs 1 slot``): a step at the slot size shows well above 1. ``--slot-mib N`` sets
``slot_bytes`` (tuned: the output says so), so that every size fits one slot.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics

from executor_bench import BackendSide, interleave, make_payload, markdown_table

KIB, MIB = 1 << 10, 1 << 20
#: The ring's default slot (MultiprocOptions.slot_bytes); a message also carries a header.
DEFAULT_SLOT_BYTES = 16 * MIB
PLUGINS = {"mp": "multiproc", "ray": "ray"}
SIZES_KIB = [4, 64, 1024, 4096, 8192, 15 * 1024, 16 * 1024, 17 * 1024, 32 * 1024, 65536, 131072]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=sorted(PLUGINS), default="mp")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=SIZES_KIB)
    parser.add_argument("--kind", choices=("tensor", "bytes"), default="tensor")
    parser.add_argument("--repeats", type=int, default=9, help="calls per size per block")
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--slot-mib", type=int, default=0, help="slot_bytes (tuned), 0: default")
    args = parser.parse_args()
    os.environ["EXECUTOR_PLUGINS"] = PLUGINS[args.backend]  # only the plugin under test
    slot_bytes = args.slot_mib * MIB or DEFAULT_SLOT_BYTES
    options = {"slot_bytes": slot_bytes} if args.slot_mib else {}
    sizes = [s * KIB for s in args.sizes_kib]
    side = BackendSide(args.backend, args.workers, options=options)
    try:
        calls = {
            size: functools.partial(side.call, "size_of", (make_payload(args.kind, size),))
            for size in sizes
        }
        assert all(calls[size]() == [size] * args.workers for size in sizes)
        times = interleave(calls, args.blocks, args.repeats, warmup=1)
    finally:
        side.close()
    medians = {size: statistics.median(samples) for size, samples in times.items()}
    one_slot = [s for s in sizes if s < min(slot_bytes, DEFAULT_SLOT_BYTES) - 64 * KIB]
    reference = max(one_slot, default=sizes[0])
    per_mib_ref = medians[reference] / (reference / MIB)
    how = f"slot_bytes={args.slot_mib} MiB (tuned)" if args.slot_mib else "default options"
    print(
        f"cores: {os.cpu_count()}; {args.backend} at {how}, {args.workers} workers, {args.kind} "
        f"argument; reference for 'vs 1 slot': {reference // KIB} KiB\n"
    )
    rows = []
    for size in sizes:
        per_mib = medians[size] / (size / MIB)
        rows.append(
            (
                f"{size // KIB:,} KiB",
                f"{medians[size] * 1e6:,.0f}",
                f"{per_mib * 1e6:,.0f}",
                f"{per_mib / per_mib_ref:.2f}",
            )
        )
    print(markdown_table(["size", "median µs", "µs per MiB", "vs 1 slot"], rows))


if __name__ == "__main__":
    main()
