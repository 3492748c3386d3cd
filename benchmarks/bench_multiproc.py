"""Multiproc backend benchmark: round trips against multiprocessing.Pipe and raw pyzmq ipc.

    .venv/bin/python benchmarks/bench_multiproc.py [--workers 1 2 4] [--calls 2000]
        [--blocks 4] [--startup-repeats 5] [--noop-rounds 0] [--busy 0]

For each worker count, ``mp`` (tuned: 32 MiB slots, so the 16 MiB payloads fit one) against
``executor bench``'s ``Pipe`` and ``zmq`` baselines with as many worker processes, in
``--blocks`` interleaved blocks: a no-op, a 1 MiB ``bytes`` argument, a 16 MiB tensor
argument and a 16 MiB result from rank 0 (``unique_reply_rank=0`` on mp). Median and p99 in
µs and mp's ratio to each. Same run: the no-op on mp with ``spin_s=0``, and the tensor over
``Connection.send`` (torch's reducer shares its storage). ``--noop-rounds R``: the no-op
against the Pipe in R rounds of fresh processes (one set of processes can land on a shared
machine's cores well or badly for its whole life), ``--busy N`` again next to N spinning
processes. Then idle workers' CPU over 1 s from 50 ms after the last call, and the time to
ready with 2 workers importing torch against 2 bare spawned processes importing it.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from executor_bench import BackendSide, PipeSide, ZmqSide, interleave, markdown_table, percentile
from executor_core import ExecutorConfig, WorkerBase, create_executor

MB = 1 << 20
TUNED = {"slot_bytes": 32 * MB, "reply_slot_bytes": 32 * MB}
SPAWN = multiprocessing.get_context("spawn")


class TorchWorker(WorkerBase):
    """A worker whose start-up imports torch (for the ready-time comparison)."""

    def init_device(self) -> None:
        import torch  # noqa: F401


def workloads(mp: BackendSide) -> dict[str, tuple[Callable[[Any], Any], int]]:
    """name -> (a call of a side, calls divisor)."""
    import torch

    tensor, one_mb = torch.ones(16 * MB // 4, dtype=torch.float32), b"x" * MB
    result = (16 * MB, 0)

    def make(side: Any) -> Any:
        if side is mp:
            return mp.executor.collective_rpc("make", args=result, unique_reply_rank=0)
        return side.call("make", result)

    return {
        "noop": (lambda side: side.call("noop", ()), 1),
        "1 MB bytes": (lambda side: side.call("size_of", (one_mb,)), 4),
        "16 MB tensor": (lambda side: side.call("size_of", (tensor,)), 20),
        "16 MB result": (make, 20),
    }


def measure(sides: dict[str, Any], load: tuple[Callable[[Any], Any], int], calls: int, blocks: int):
    call, divisor = load
    per_block = max(5, calls // divisor // blocks)
    return interleave(
        {n: (lambda s=s: call(s)) for n, s in sides.items()}, blocks, per_block, warmup=6
    )


def fresh_rounds(workers: int, rounds: int, calls: int) -> tuple[list[float], list[float]]:
    """The no-op's p50 on mp and on the Pipe in ``rounds`` rounds of fresh processes."""
    mps, pipes = [], []
    for turn in range(rounds):
        names = ("mp", "Pipe") if turn % 2 == 0 else ("Pipe", "mp")  # the creation order
        sides = {
            n: BackendSide("mp", workers, options=TUNED) if n == "mp" else PipeSide(workers)
            for n in names
        }
        try:
            got = measure(sides, (lambda side: side.call("noop", ()), 1), calls, 6)
        finally:
            for side in sides.values():
                side.close()
        mps.append(statistics.median(got["mp"]))
        pipes.append(statistics.median(got["Pipe"]))
    return mps, pipes


def idle_cpu_percent(side: BackendSide) -> list[float]:
    import psutil  # type: ignore[import-untyped]

    procs = [psutil.Process(pid) for pid in side.call("pid", ())]
    time.sleep(0.05)
    before, start = [sum(p.cpu_times()[:2]) for p in procs], time.monotonic()
    time.sleep(1.0)
    elapsed = time.monotonic() - start
    return [
        100 * (sum(p.cpu_times()[:2]) - b) / elapsed for p, b in zip(procs, before, strict=True)
    ]


def bare_torch_process(conn: Connection) -> None:
    import torch

    conn.send(torch.__version__)
    conn.recv()


def bare_spawn_s(workers: int) -> float:
    start = time.perf_counter()
    pairs = [SPAWN.Pipe() for _ in range(workers)]
    procs = [SPAWN.Process(target=bare_torch_process, args=(b,), daemon=True) for _, b in pairs]
    for proc in procs:
        proc.start()
    for here, _ in pairs:
        here.recv()
    elapsed = time.perf_counter() - start
    for (here, _), proc in zip(pairs, procs, strict=True):
        here.send(None)
        proc.join(10)
    return elapsed


def ready_s(workers: int) -> float:
    start = time.perf_counter()
    config = ExecutorConfig(worker_cls=TorchWorker, backend="mp", tensor_parallel_size=workers)
    executor = create_executor(config)
    elapsed = time.perf_counter() - start
    executor.shutdown()
    return elapsed


def busy_loop() -> None:
    while True:
        pass


def p99(samples: list[float]) -> float:
    return percentile(samples, 0.99)


def us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f}"


def main() -> None:
    os.environ["EXECUTOR_PLUGINS"] = "multiproc"  # only the plugin under test, here and in workers
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--calls", type=int, default=2000, help="no-op calls per side")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--startup-repeats", type=int, default=5)
    parser.add_argument("--noop-rounds", type=int, default=0, help="no-op rounds, fresh processes")
    parser.add_argument("--busy", type=int, default=0, help="and again next to N busy processes")
    args = parser.parse_args()
    print(f"cores: {os.cpu_count()}; µs; mp tuned: {TUNED} (every other option at its default)\n")
    rows, notes = [], []
    for workers in args.workers:
        sides = {"mp": BackendSide("mp", workers, options=TUNED), "Pipe": PipeSide(workers)}
        sides["zmq"] = ZmqSide(workers)
        extra = {"spin_s=0": BackendSide("mp", workers, options={**TUNED, "spin_s": 0.0})}
        extra["Connection.send"] = PipeSide(workers, shared=True)
        try:
            for name, load in workloads(sides["mp"]).items():
                noted = {"noop": "spin_s=0", "16 MB tensor": "Connection.send"}.get(name)
                got = measure(
                    {**sides, **({noted: extra[noted]} if noted else {})},
                    load,
                    args.calls,
                    args.blocks,
                )
                if noted:
                    times = got.pop(noted)
                    p50, tail = us(statistics.median(times)), us(p99(times))
                    notes.append(f"{workers} worker(s), {name} over {noted}: p50 {p50}, p99 {tail}")
                m, p, z = (statistics.median(got[n]) for n in ("mp", "Pipe", "zmq"))
                cells = [us(f(t)) for t in got.values() for f in (statistics.median, p99)]
                rows.append([workers, name, *cells, f"{m / p:.2f}", f"{m / z:.2f}"])
                print(f"| {' | '.join(map(str, rows[-1]))} |", flush=True)
            idle = idle_cpu_percent(sides["mp"])
            notes.append(
                f"idle mp workers' CPU over 1 s, {workers} worker(s): "
                + ", ".join(f"{x:.2f}%" for x in idle)
            )
        finally:
            for side in [*sides.values(), *extra.values()]:
                side.close()
    header = ["workers", "workload"] + [
        f"{n} {q}" for n in ("mp", "Pipe", "zmq") for q in ("p50", "p99")
    ]
    print("\n" + markdown_table([*header, "mp/Pipe", "mp/zmq"], rows) + "\n")
    print("\n".join(f"* {note}" for note in notes))
    for busy in sorted({0, args.busy}) if args.noop_rounds else []:
        hogs = [SPAWN.Process(target=busy_loop, daemon=True) for _ in range(busy)]
        for hog in hogs:
            hog.start()
        try:
            for workers in args.workers:
                mps, pipes = fresh_rounds(workers, args.noop_rounds, args.calls)
                ratios = sorted(m / p for m, p in zip(mps, pipes, strict=True))
                print(
                    f"no-op, {args.noop_rounds} rounds of fresh processes, {busy} busy "
                    f"process(es), {workers} worker(s): median mp/Pipe "
                    f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f}); median "
                    f"p50 mp {us(statistics.median(mps))}, Pipe {us(statistics.median(pipes))}",
                    flush=True,
                )
        finally:
            for hog in hogs:
                hog.kill()
                hog.join(10)
    bare_spawn_s(2)  # warm the page cache for torch's files, untimed
    bare, ready = [], []
    for repeat in range(args.startup_repeats):  # which goes first alternates
        first, second = (ready_s, bare_spawn_s) if repeat % 2 else (bare_spawn_s, ready_s)
        results = {f: f(2) for f in (first, second)}
        bare.append(results[bare_spawn_s])
        ready.append(results[ready_s])
    b, r = statistics.median(bare), statistics.median(ready)
    print(
        f"\nready with 2 torch-importing workers: create_executor {r:.2f} s, bare spawn "
        f"{b:.2f} s, ratio {r / b:.2f} (medians of {args.startup_repeats})"
    )


if __name__ == "__main__":
    main()
