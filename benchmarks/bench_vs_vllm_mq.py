"""A CPU tensor to 2 workers: the mp backend against vLLM's shared-memory MessageQueue.

    .venv/bin/python benchmarks/bench_vs_vllm_mq.py --vllm-path DIR [--blocks 8]
        [--reply pipe|mq] [--settle-s 1.2] [--scale 1.0]

Issue 13, item 5: "A 16 MiB CPU tensor to 2 workers costs at most 0.8x vLLM's MessageQueue
out-of-band path measured in the same run."

``mp``: the mp backend at its default options (``EXECUTOR_PLUGINS=multiproc``, as in
bench_multiproc.py, so that the development install's test fixtures are not loaded), 2
workers, ``collective_rpc("size_of", args=(tensor,))``: every worker receives the float32 CPU
tensor and returns its size in bytes (``executor bench``'s worker and vLLM baseline).

``vLLM MQ``: vLLM's ``MessageQueue`` (vllm/distributed/device_communicators/shm_broadcast.py)
with one writer (this process) and 2 local reader processes, at the constructor's defaults
(``max_chunk_bytes`` 24 MiB, ``max_chunks`` 10, no tensor arena). The writer enqueues
``("size_of", (tensor,))``: vLLM pickles with protocol 5 and a ``buffer_callback`` that takes
buffers of 1 MiB and more out of band (a CPU tensor becomes one such buffer); a message that
fits ``max_chunk_bytes`` goes through the shared-memory ring (the writer copies it in, each
reader copies the out-of-band buffer out), a larger one overflows to a zmq ipc socket. Each
reader dequeues (``indefinite=True``, as vLLM's worker loop does) and replies with the tiny
size through a ``multiprocessing.Pipe`` (``send_bytes`` of pickle protocol 5): the
cheapest reply path measured. ``--reply mq`` answers instead through the reader's own
``MessageQueue(1, 1)`` with the reader as its writer, the way vLLM's workers answer: slower
at the no-op, the same within noise with tensors. vLLM's waiting is kept as it is: a reader
spins (``os.sched_yield``) for 1 s after its last read before it sleeps on a zmq
notification; a writer waiting for a free chunk spins too.

``vLLM MQ 16MiB chunk`` (the 16 MiB row only): the same with ``max_chunk_bytes`` 16 MiB,
which is what vLLM's multiproc executor passes (``VLLM_MQ_MAX_CHUNK_BYTES_MB`` defaults to
16): there a 16 MiB tensor does not fit a chunk and overflows to the zmq socket. For the
other sizes the two settings take the same path (1 MiB and the no-op fit both; 64 MiB
overflows both).

The sides run in the same run, interleaved in ``--blocks`` blocks per size (the order
alternating). After each vLLM block the run sleeps ``--settle-s`` seconds so that the
readers' 1 s of spinning is over before the next side is timed (without this, 2 spinning
readers on a small machine slow whatever runs next). Before timing, each side makes 12
untimed calls per size (vLLM's first write to each of its 10 chunks takes the page faults);
the first call of every block is not timed either. Reported: median and p99 per round trip
in µs, and mp's median over vLLM's.

vLLM is not a dependency: ``--vllm-path DIR`` (default ``$VLLM_MQ_PATH``) must be a
directory from which ``vllm.distributed.device_communicators.shm_broadcast`` imports (a
vLLM install's site-packages, or a directory holding that file with stand-ins for the few
vllm modules it imports).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import statistics
import sys
import time
from typing import Any

from executor_bench._baselines import VllmQueueSide
from executor_bench._worker import BenchWorker
from executor_core import ExecutorConfig, create_executor

MB = 1 << 20
SHM_MODULE = "vllm.distributed.device_communicators.shm_broadcast"
HEADLINE = "16 MiB tensor"
#: Untimed calls per side and size first: more than vLLM's ring has chunks (10), whose
#: first write of each chunk takes the page faults (several times a warm call).
WARMUP_CALLS = 12
HOW_TO_GET = """\
Get vLLM's shm_broadcast.py without installing vllm into this project, for example:
  .venv/bin/pip download vllm --no-deps -d /tmp/vllm-dl
  cd /tmp/vllm-dl && unzip -q vllm-*.whl \\
      'vllm/distributed/device_communicators/shm_broadcast.py'
then make it importable from one directory (an empty vllm/__init__.py and
vllm/distributed/__init__.py, vllm/distributed/device_communicators/__init__.py, and
minimal stand-ins for what it imports: vllm.envs, vllm.logger, vllm.platforms,
vllm.distributed.utils (sched_yield, StatelessProcessGroup), vllm.utils.network_utils,
vllm.utils.cpu_resource_utils), or point --vllm-path at a site-packages with vllm installed.
Then: --vllm-path DIR, or VLLM_MQ_PATH=DIR."""


# --- vLLM's side -------------------------------------------------------------------------


class VllmQueue(VllmQueueSide):
    """``executor bench``'s vLLM baseline, with a name for the table."""

    spins = True

    def __init__(self, workers: int, reply: str, max_chunk_bytes: int | None = None) -> None:
        super().__init__(workers, own_replies=reply == "mq", max_chunk_bytes=max_chunk_bytes)
        self.name = "vLLM MQ" if max_chunk_bytes is None else "vLLM MQ 16MiB chunk"


# --- ours --------------------------------------------------------------------------------


class Mp:
    name = "mp"
    spins = False

    def __init__(self, workers: int) -> None:
        self.executor = create_executor(
            ExecutorConfig(worker_cls=BenchWorker, backend="mp", tensor_parallel_size=workers)
        )

    def call(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        return self.executor.collective_rpc(method, args=args)

    def close(self) -> None:
        self.executor.shutdown()


# --- measuring ---------------------------------------------------------------------------


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(
    sides: list[Any],
    method: str,
    args: tuple[Any, ...],
    expect: Any,
    calls: int,
    blocks: int,
    settle_s: float,
) -> dict[str, list[float]]:
    """``calls`` timed round trips per side, in ``blocks`` interleaved blocks."""
    samples: dict[str, list[float]] = {side.name: [] for side in sides}
    per_block = max(3, calls // blocks)
    for side in sides:  # warm-up: touch every slot of the rings (vLLM's has 10) once
        for _ in range(WARMUP_CALLS):
            side.call(method, args)
        if side.spins:
            time.sleep(settle_s)
    for block in range(blocks):
        order = sides if block % 2 == 0 else sides[::-1]
        for side in order:
            out = samples[side.name]
            result = side.call(method, args)  # untimed: wakes the side up
            assert result == [expect, expect], (side.name, result)
            for _ in range(per_block):
                start = time.perf_counter()
                side.call(method, args)
                out.append(time.perf_counter() - start)
            if side.spins:
                time.sleep(settle_s)
    return samples


def fmt(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f}"


def import_vllm(path: str | None) -> Any:
    if not path:
        print(f"No --vllm-path given and VLLM_MQ_PATH is not set.\n\n{HOW_TO_GET}")
        sys.exit(2)
    sys.path.insert(0, os.path.abspath(path))  # spawned readers inherit sys.path
    try:
        module = importlib.import_module(SHM_MODULE)
        module.MessageQueue  # noqa: B018  (fail here, not in a reader)
    except Exception as exc:  # noqa: BLE001  (any failure: say how to get it)
        print(f"Cannot import {SHM_MODULE} from {path}: {exc!r}\n\n{HOW_TO_GET}")
        sys.exit(2)
    return module


def describe_vllm(module: Any) -> str:
    vllm = sys.modules.get("vllm")
    version = getattr(vllm, "__version__", "unknown version")
    return f"vllm {version} from {os.path.dirname(os.path.abspath(module.__file__))}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-path", default=os.environ.get("VLLM_MQ_PATH"))
    parser.add_argument("--blocks", type=int, default=8, help="interleaved blocks per size")
    parser.add_argument(
        "--reply",
        choices=("mq", "pipe"),
        default="pipe",
        help="how vLLM's readers answer: a Pipe, or their own MessageQueue(1, 1)",
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=1.2,
        help="sleep after each vLLM block (its readers spin for 1 s after a read)",
    )
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply the number of calls per size"
    )
    parser.add_argument(
        "--only", nargs="+", metavar="NAME", help="workloads to run (noop, '16 MiB tensor', ...)"
    )
    args = parser.parse_args()
    module = import_vllm(args.vllm_path)
    # Load only the plugin under test (the dev install also has test fixtures).
    os.environ["EXECUTOR_PLUGINS"] = "multiproc"

    import torch

    workers = 2
    # name -> (method, args, expected reply per worker, timed calls per side)
    workloads: dict[str, tuple[str, tuple[Any, ...], Any, int]] = {"noop": ("noop", (), None, 2000)}
    for mib, calls in ((1, 800), (16, 400), (64, 80)):
        tensor = torch.ones(mib * MB // 4, dtype=torch.float32)
        workloads[f"{mib} MiB tensor"] = ("size_of", (tensor,), mib * MB, calls)
    if args.only:
        workloads = {name: workloads[name] for name in args.only}

    print(
        f"cores: {os.cpu_count()}; load average at start: "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
    )
    print(f"baseline: {describe_vllm(module)}; vLLM readers reply via {args.reply}")
    print(
        f"{workers} workers; times in µs per round trip; ratio = mp median / vLLM median; "
        f"{args.blocks} interleaved blocks per size, {args.settle_s:g} s settle after "
        "each vLLM block\n"
    )
    samples: dict[str, dict[str, list[float]]] = {}
    sides: list[Any] = []
    try:
        sides = [Mp(workers)]
        for chunk in (None, 16 * MB):
            sides.append(VllmQueue(workers, args.reply, max_chunk_bytes=chunk))
        for name, (method, call_args, expect, calls) in workloads.items():
            here = sides if name == HEADLINE else sides[:2]
            samples[name] = measure(
                here,
                method,
                call_args,
                expect,
                max(args.blocks, int(calls * args.scale)),
                args.blocks,
                args.settle_s,
            )
    finally:
        for side in sides:
            side.close()
        sides.clear()
        gc.collect()  # each side removed its rings and sockets when it closed

    print("| size | side | median µs | p99 µs | n | mp / this |")
    print("|---|---|---|---|---|---|")
    ratios: dict[str, float] = {}
    for name, by_side in samples.items():
        mp_median = statistics.median(by_side["mp"])
        for side_name, times in by_side.items():
            median = statistics.median(times)
            ratio = "" if side_name == "mp" else f"{mp_median / median:.2f}"
            if side_name == "vLLM MQ":
                ratios[name] = mp_median / median
            print(
                f"| {name} | {side_name} | {fmt(median)} | {fmt(percentile(times, 0.99))} "
                f"| {len(times)} | {ratio} |"
            )
    print()
    if HEADLINE in ratios:
        headline = samples[HEADLINE]
        print(f"{HEADLINE}: mp / vLLM MQ = {ratios[HEADLINE]:.2f} (target <= 0.8x)")
        if "vLLM MQ 16MiB chunk" in headline:
            other = statistics.median(headline["mp"]) / statistics.median(
                headline["vLLM MQ 16MiB chunk"]
            )
            print(
                f"{HEADLINE}: mp / vLLM MQ with the executor's 16 MiB chunk (zmq overflow) "
                f"= {other:.2f}"
            )
    print(
        "load average at end: " + " ".join(f"{x:.2f}" for x in os.getloadavg()),
    )


if __name__ == "__main__":
    main()
