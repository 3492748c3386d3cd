"""Payload sweep at default options: the cost per byte of a call's argument, by size.

    .venv/bin/python benchmarks/bench_payload_sweep.py [--backend mp|ray] [--workers 2]
        [--sizes-kib 4 ... 131072] [--kind tensor|bytes] [--repeats 9] [--blocks 3] [--slot-mib N]

Each call sends one argument (a CPU float32 tensor, or ``bytes``) of the given size to every
worker, which returns its length; the driver waits for all replies. The ring's slots are 16 MiB
at default options, so sizes above that take the path a message spanning several slots takes.
Reported per size: the median time per call in µs, the cost in µs per MiB, and that cost
over the cost per MiB of the largest size that fits one slot (``vs 1 slot``): a step at the
slot size shows as a ratio well above 1. Sizes are interleaved in ``--blocks`` blocks so
that load from other processes hits them alike.

``--slot-mib N`` sets ``slot_bytes`` (a tuned option: its rows say so) so that every size
fits one slot, which separates what the ring costs from what the receiver's fresh memory
costs.

``--backend ray`` runs the same on Ray (one node: the workers read the driver's rings).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from executor_core import ExecutorConfig, WorkerBase, create_executor

KIB = 1 << 10
MIB = 1 << 20
#: The ring's default slot (MultiprocOptions.slot_bytes); a message also carries a header.
DEFAULT_SLOT_BYTES = 16 * MIB

#: The plugin each backend comes from (only the one under test is loaded).
PLUGINS = {"mp": "multiproc", "ray": "ray"}


class SizeWorker(WorkerBase):
    """Returns the size of what it was sent."""

    def size_of(self, payload: Any) -> int:
        if isinstance(payload, bytes):
            return len(payload)
        return int(payload.numel() * payload.element_size())


def make_payload(kind: str, nbytes: int) -> Any:
    if kind == "bytes":
        return os.urandom(nbytes)
    import torch

    return torch.rand(nbytes // 4, dtype=torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=sorted(PLUGINS), default="mp")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--sizes-kib",
        type=int,
        nargs="+",
        default=[
            *(4, 64, 1024, 4096, 8192),
            *(15 * 1024, 16 * 1024, 17 * 1024, 32 * 1024, 65536, 131072),
        ],
    )
    parser.add_argument("--kind", choices=("tensor", "bytes"), default="tensor")
    parser.add_argument("--repeats", type=int, default=9, help="calls per size per block")
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--slot-mib", type=int, default=0, help="slot_bytes (tuned), 0: default")
    args = parser.parse_args()
    os.environ["EXECUTOR_PLUGINS"] = PLUGINS[args.backend]  # only the plugin under test
    slot_bytes = args.slot_mib * MIB or DEFAULT_SLOT_BYTES
    options = {"slot_bytes": slot_bytes} if args.slot_mib else {}

    sizes = [s * KIB for s in args.sizes_kib]
    payloads = {size: make_payload(args.kind, size) for size in sizes}
    config = ExecutorConfig(
        worker_cls=SizeWorker,
        backend=args.backend,
        tensor_parallel_size=args.workers,
        backend_options=options,
    )
    times: dict[int, list[float]] = {size: [] for size in sizes}
    with create_executor(config) as executor:
        for size in sizes:  # warm-up: first touches of the ring and the workers' allocator
            executor.collective_rpc("size_of", args=(payloads[size],))
        for _block in range(args.blocks):
            for size in sizes:
                payload = payloads[size]
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    result = executor.collective_rpc("size_of", args=(payload,))
                    times[size].append(time.perf_counter() - start)
                    assert result == [size] * args.workers

    medians = {size: statistics.median(samples) for size, samples in times.items()}
    one_slot = [s for s in sizes if s < min(slot_bytes, DEFAULT_SLOT_BYTES) - 64 * KIB]
    reference = max(one_slot, default=sizes[0])
    per_mib_ref = medians[reference] / (reference / MIB)
    tuned = [f"slot_bytes={args.slot_mib} MiB"] if args.slot_mib else []
    print(
        f"cores: {os.cpu_count()}; {args.backend} at "
        f"{'; '.join(tuned) + ' (tuned)' if tuned else 'default options'}, "
        f"{args.workers} workers, "
        f"{args.kind} argument; reference for 'vs 1 slot': {reference // KIB} KiB\n"
    )
    print("| size | median µs | µs per MiB | vs 1 slot |")
    print("|---|---|---|---|")
    for size in sizes:
        per_mib = medians[size] / (size / MIB)
        print(
            f"| {size // KIB:,} KiB | {medians[size] * 1e6:,.0f} | {per_mib * 1e6:,.0f} "
            f"| {per_mib / per_mib_ref:.2f} |"
        )


if __name__ == "__main__":
    main()
