"""Multiproc backend benchmark: round trips against multiprocessing.Pipe and raw pyzmq ipc.

    .venv/bin/python benchmarks/bench_multiproc.py [--workers 1 2 4] [--calls 2000]
        [--blocks 4] [--startup-repeats 5] [--noop-rounds 0] [--busy 0]

For 1, 2 and 4 workers, in one run, each workload is measured on the ``mp`` executor and on
two baselines that do the same request/reply with the same number of worker processes:
``mp.Pipe`` (a ``multiprocessing.Pipe`` per worker carrying pickle protocol 5 bytes) and
``zmq ipc`` (a pyzmq PAIR socket over ipc per worker, pickle protocol 5). The transports are
interleaved in ``--blocks`` blocks so that load from other processes hits them alike.
Reported: median and p99 in µs, and the ratio of the mp median to each baseline's. Also, in
the same run: the noop on mp with ``spin_s=0``, and the 16MB tensor over
``Connection.send`` (torch's shared-memory reducer, no copy).

Only the plugin under test is loaded (``EXECUTOR_PLUGINS=multiproc``): the development
install also registers test fixtures, among them an observer hook that runs on every call.

Workloads: ``noop`` (a method that returns None), ``1MB bytes`` (an argument every worker
receives), ``16MB tensor`` (a CPU float32 tensor argument), ``16MB result`` (rank 0 returns
16 MiB of bytes; ``unique_reply_rank=0`` on mp, the other baseline workers answer None).

``--noop-rounds R``: the no-op against ``mp.Pipe`` again in R rounds, each with fresh
processes (the creation order alternating), reporting the median and range of the per-round
ratios. On a shared 2-core machine one set of processes can land on the cores well or badly
for the whole of its life, so a single run's no-op ratio swings far more than its noise
within the run suggests. ``--busy N`` runs those rounds a second time next to N processes
that spin on the CPU (other jobs on a shared machine).

Then: CPU time used by idle mp workers over 1 s, starting 50 ms after the last call; and the
time from ``create_executor`` to ready with 2 workers that import torch, against spawning 2
bare processes that import torch and report back.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pickle
import statistics
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from executor_core import ExecutorConfig, WorkerBase, create_executor

MB = 1 << 20
TENSOR_BYTES = 16 * MB
RESULT_BYTES = 16 * MB
#: Slots big enough for the 16 MiB payloads in one piece (the default is 16 MiB).
BACKEND_OPTIONS = {"slot_bytes": 32 * MB, "reply_slot_bytes": 32 * MB}


class Target:
    """What every transport calls: the same methods on the same kind of object."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def noop(self) -> None:
        return None

    def size(self, data: Any) -> int:
        return int(data.nbytes) if hasattr(data, "nbytes") else len(data)

    def make(self, nbytes: int, on_rank: int) -> bytes | None:
        return b"r" * nbytes if self.rank == on_rank else None


class BenchWorker(WorkerBase):
    """The mp executor's worker: delegates to :class:`Target`."""

    def init_device(self) -> None:
        self.target = Target(self.rank)

    def noop(self) -> None:
        return None

    def size(self, data: Any) -> int:
        return self.target.size(data)

    def make(self, nbytes: int, on_rank: int) -> bytes | None:
        return self.target.make(nbytes, on_rank)


class TorchWorker(WorkerBase):
    """A worker whose start-up imports torch (for the ready-time comparison)."""

    def init_device(self) -> None:
        import torch

        self.version = torch.__version__


# --- baselines ---------------------------------------------------------------------------


def pipe_server(conn: Connection, rank: int, plain: bool) -> None:
    target = Target(rank)
    while True:
        message = pickle.loads(conn.recv_bytes()) if plain else conn.recv()
        if message is None:
            return
        method, args = message
        result = getattr(target, method)(*args)
        if plain:
            conn.send_bytes(pickle.dumps(result, protocol=5))
        else:
            conn.send(result)


def zmq_server(address: str, rank: int) -> None:
    import zmq

    target = Target(rank)
    sock: Any = zmq.Context.instance().socket(zmq.PAIR)
    sock.connect(address)
    while True:
        message = pickle.loads(sock.recv(copy=False).buffer)
        if message is None:
            break
        method, args = message
        sock.send(pickle.dumps(getattr(target, method)(*args), protocol=5), copy=False)
    sock.close(linger=0)


class PipeBaseline:
    """A Pipe per worker. ``plain``: pickle protocol 5 bytes (``send_bytes``); otherwise
    ``Connection.send``, whose ForkingPickler has torch's reducers once torch is imported:
    those move a tensor's storage into shared memory and send only a handle."""

    name = "mp.Pipe"

    def __init__(self, workers: int, plain: bool = True) -> None:
        self.plain = plain
        if not plain:
            self.name = "mp.Pipe send (torch shares storage)"
        ctx = multiprocessing.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs = []
        for rank in range(workers):
            here, there = ctx.Pipe()
            proc = ctx.Process(target=pipe_server, args=(there, rank, plain), daemon=True)
            proc.start()
            there.close()
            self.conns.append(here)
            self.procs.append(proc)

    def call(self, method: str, args: tuple[Any, ...], only_rank: int | None = None) -> Any:
        if self.plain:
            for conn in self.conns:
                conn.send_bytes(pickle.dumps((method, args), protocol=5))
            results = [pickle.loads(conn.recv_bytes()) for conn in self.conns]
        else:
            for conn in self.conns:
                conn.send((method, args))
            results = [conn.recv() for conn in self.conns]
        return results if only_rank is None else [results[only_rank]]

    def close(self) -> None:
        for conn in self.conns:
            if self.plain:
                conn.send_bytes(pickle.dumps(None))
            else:
                conn.send(None)
        for proc in self.procs:
            proc.join(10)


class ZmqBaseline:
    name = "zmq ipc"

    def __init__(self, workers: int) -> None:
        import zmq

        self.tmp = tempfile.TemporaryDirectory()
        self.ctx = zmq.Context()
        self.socks: list[Any] = []
        self.procs = []
        mp_ctx = multiprocessing.get_context("spawn")
        for rank in range(workers):
            address = f"ipc://{self.tmp.name}/w{rank}"
            sock = self.ctx.socket(zmq.PAIR)
            sock.bind(address)
            proc = mp_ctx.Process(target=zmq_server, args=(address, rank), daemon=True)
            proc.start()
            self.socks.append(sock)
            self.procs.append(proc)

    def call(self, method: str, args: tuple[Any, ...], only_rank: int | None = None) -> Any:
        payload = pickle.dumps((method, args), protocol=5)
        for sock in self.socks:
            sock.send(payload, copy=False)
        results = [pickle.loads(sock.recv(copy=False).buffer) for sock in self.socks]
        return results if only_rank is None else [results[only_rank]]

    def close(self) -> None:
        for sock in self.socks:
            sock.send(pickle.dumps(None))
        for proc in self.procs:
            proc.join(10)
        for sock in self.socks:
            sock.close(linger=0)
        self.ctx.term()
        self.tmp.cleanup()


class MpTransport:
    name = "mp"

    def __init__(self, workers: int, spin_s: float | None = None) -> None:
        options: dict[str, Any] = dict(BACKEND_OPTIONS)
        if spin_s is not None:
            options["spin_s"] = spin_s
            self.name = f"mp spin_s={spin_s:g}"
        self.executor = create_executor(
            ExecutorConfig(
                worker_cls=BenchWorker,
                backend="mp",
                tensor_parallel_size=workers,
                backend_options=options,
            )
        )

    def call(self, method: str, args: tuple[Any, ...], only_rank: int | None = None) -> Any:
        return self.executor.collective_rpc(method, args=args, unique_reply_rank=only_rank)

    def close(self) -> None:
        self.executor.shutdown()


# --- measuring ---------------------------------------------------------------------------


def workloads() -> dict[str, tuple[str, tuple[Any, ...], int | None, int]]:
    """name -> (method, args, only_rank, calls divisor)."""
    import torch

    tensor = torch.ones(TENSOR_BYTES // 4, dtype=torch.float32)
    return {
        "noop": ("noop", (), None, 1),
        "1MB bytes": ("size", (b"x" * MB,), None, 4),
        "16MB tensor": ("size", (tensor,), None, 20),
        "16MB result": ("make", (RESULT_BYTES, 0), 0, 20),
    }


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(
    transports: list[Any],
    calls: int,
    blocks: int,
    only: str | None = None,
    noop_only: tuple[Any, ...] = (),
) -> dict[str, dict[str, list[float]]]:
    """Samples by workload and transport; ``noop_only`` transports run the noop only."""
    samples: dict[str, dict[str, list[float]]] = {}
    for name, (method, args, only_rank, divisor) in workloads().items():
        if only is not None and name != only:
            continue
        per_block = max(5, calls // divisor // blocks)
        here = [*transports, *noop_only] if name == "noop" else transports
        samples[name] = {t.name: [] for t in here}
        for transport in here:  # warm-up (imports torch in the workers, fills slots)
            for _ in range(6):
                transport.call(method, args, only_rank)
        for _ in range(blocks):
            for transport in here:
                out = samples[name][transport.name]
                for _ in range(per_block):
                    start = time.perf_counter()
                    transport.call(method, args, only_rank)
                    out.append(time.perf_counter() - start)
    return samples


def busy_loop() -> None:
    while True:
        pass


def noop_rounds(workers: int, rounds: int, calls: int) -> list[tuple[float, float]]:
    """(mp p50, Pipe p50) of the no-op in ``rounds`` rounds of fresh processes."""
    results = []
    for round_ in range(rounds):
        makers: list[Callable[[int], Any]] = [MpTransport, PipeBaseline]
        if round_ % 2:
            makers.reverse()
        transports = [make(workers) for make in makers]
        try:
            samples = measure(transports, calls, 6, only="noop")["noop"]
        finally:
            for transport in transports:
                transport.close()
        results.append((statistics.median(samples["mp"]), statistics.median(samples["mp.Pipe"])))
    return results


def idle_cpu_percent(executor: Any) -> list[float]:
    import psutil

    # The worker group: on the executor before the core's Transport contract, on its
    # transport since.
    group = getattr(executor, "_group", None) or executor.transport._group
    pids = [p for p in group.pids if p is not None]
    executor.collective_rpc("noop")
    time.sleep(0.05)
    procs = [psutil.Process(pid) for pid in pids]
    before = [sum(p.cpu_times()[:2]) for p in procs]
    start = time.monotonic()
    time.sleep(1.0)
    elapsed = time.monotonic() - start
    after = [sum(p.cpu_times()[:2]) for p in procs]
    return [100.0 * (a - b) / elapsed for a, b in zip(after, before, strict=True)]


def bare_torch_process(conn: Connection) -> None:
    import torch

    conn.send(torch.__version__)
    conn.recv()


def bare_spawn_seconds(workers: int) -> float:
    ctx = multiprocessing.get_context("spawn")
    start = time.perf_counter()
    pairs = []
    for _ in range(workers):
        here, there = ctx.Pipe()
        proc = ctx.Process(target=bare_torch_process, args=(there,), daemon=True)
        proc.start()
        pairs.append((here, proc))
    for here, _ in pairs:
        here.recv()
    elapsed = time.perf_counter() - start
    for here, proc in pairs:
        here.send(None)
        proc.join(10)
    return elapsed


def executor_ready_seconds(workers: int) -> float:
    start = time.perf_counter()
    executor = create_executor(
        ExecutorConfig(worker_cls=TorchWorker, backend="mp", tensor_parallel_size=workers)
    )
    elapsed = time.perf_counter() - start
    executor.shutdown()
    return elapsed


def fmt(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f}"


def main() -> None:
    # Load only the plugin under test in the driver and the workers: the dev install also
    # has test fixtures (an observer hook that runs on every call).
    os.environ["EXECUTOR_PLUGINS"] = "multiproc"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--calls", type=int, default=2000, help="no-op calls per transport")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--startup-repeats", type=int, default=5)
    parser.add_argument(
        "--noop-rounds", type=int, default=0, help="extra no-op rounds with fresh processes"
    )
    parser.add_argument(
        "--busy", type=int, default=0, help="repeat the no-op rounds next to N busy processes"
    )
    args = parser.parse_args()

    print(f"cores: {os.cpu_count()}; times in µs; ratio = mp median / baseline median")
    tuned = ", ".join(f"{key}={value // MB} MiB" for key, value in BACKEND_OPTIONS.items())
    print(f"mp rows are tuned: {tuned} (every other option at its default)\n")
    print(
        "| workers | workload | mp p50 | mp p99 | mp.Pipe p50 | mp.Pipe p99 | zmq p50 "
        "| zmq p99 | mp/Pipe | mp/zmq |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    idle: dict[int, list[float]] = {}
    shared: dict[int, list[float]] = {}
    no_spin: dict[int, list[float]] = {}
    for workers in args.workers:
        makers: list[Callable[[int], Any]] = [MpTransport, PipeBaseline, ZmqBaseline]
        transports = [make(workers) for make in makers]
        without_spin = MpTransport(workers, spin_s=0.0)
        try:
            samples = measure(transports, args.calls, args.blocks, noop_only=(without_spin,))
            idle[workers] = idle_cpu_percent(transports[0].executor)
        finally:
            for transport in [*transports, without_spin]:
                transport.close()
        no_spin[workers] = samples["noop"].pop(without_spin.name)
        sharing = PipeBaseline(workers, plain=False)
        try:
            shared[workers] = measure([sharing], args.calls, args.blocks, "16MB tensor")[
                "16MB tensor"
            ][sharing.name]
        finally:
            sharing.close()
        for name, by_transport in samples.items():
            mp, pipe, zmq = (by_transport[t] for t in ("mp", "mp.Pipe", "zmq ipc"))
            m, p, z = (statistics.median(s) for s in (mp, pipe, zmq))
            print(
                f"| {workers} | {name} | {fmt(m)} | {fmt(percentile(mp, 0.99))} | {fmt(p)} "
                f"| {fmt(percentile(pipe, 0.99))} | {fmt(z)} | {fmt(percentile(zmq, 0.99))} "
                f"| {m / p:.2f} | {m / z:.2f} |",
                flush=True,
            )
    print(
        "\n16MB tensor over Connection.send, where torch's ForkingPickler reducer moves the"
        "\nstorage into shared memory once and then sends only a handle (no copy; the workers"
        "\nalias the driver's tensor, unlike mp and the baselines above):"
    )
    for workers, times in shared.items():
        print(
            f"  {workers} worker(s): p50 {fmt(statistics.median(times))} µs, "
            f"p99 {fmt(percentile(times, 0.99))} µs"
        )
    print("\nnoop with spin_s=0 (never spin, always sleep on the eventfd), same run:")
    for workers, times in no_spin.items():
        print(
            f"  {workers} worker(s): p50 {fmt(statistics.median(times))} µs, "
            f"p99 {fmt(percentile(times, 0.99))} µs"
        )
    print("\nidle mp worker CPU over 1 s (from 50 ms after the last call):")
    for workers, percents in idle.items():
        print(f"  {workers} worker(s): " + ", ".join(f"{p:.2f}%" for p in percents))

    for busy in sorted({0, args.busy}) if args.noop_rounds else []:
        print(
            f"\nnoop in {args.noop_rounds} rounds of fresh processes next to {busy} busy "
            "process(es) (mp p50 / Pipe p50):"
        )
        hogs = [
            multiprocessing.get_context("spawn").Process(target=busy_loop, daemon=True)
            for _ in range(busy)
        ]
        for hog in hogs:
            hog.start()
        try:
            for workers in args.workers:
                rounds = noop_rounds(workers, args.noop_rounds, args.calls)
                ratios = sorted(m / p for m, p in rounds)
                print(
                    f"  {workers} worker(s): median ratio {statistics.median(ratios):.2f} "
                    f"(range {ratios[0]:.2f}-{ratios[-1]:.2f}); median p50 mp "
                    f"{fmt(statistics.median(m for m, _ in rounds))} µs, Pipe "
                    f"{fmt(statistics.median(p for _, p in rounds))} µs",
                    flush=True,
                )
        finally:
            for hog in hogs:
                hog.kill()
                hog.join(10)

    bare_spawn_seconds(2)  # warm the page cache for torch's files, untimed
    bare, ready = [], []
    for repeat in range(args.startup_repeats):  # alternate which goes first
        if repeat % 2:
            ready.append(executor_ready_seconds(2))
            bare.append(bare_spawn_seconds(2))
        else:
            bare.append(bare_spawn_seconds(2))
            ready.append(executor_ready_seconds(2))
    b, r = statistics.median(bare), statistics.median(ready)
    print(
        f"\nready with 2 torch-importing workers: create_executor {r:.2f} s, "
        f"bare spawn {b:.2f} s, ratio {r / b:.2f} (medians of {args.startup_repeats})"
    )


if __name__ == "__main__":
    main()
