"""Recovery: a rank replacement and a group restart after a SIGKILL against a new executor,
and recovery's cost on the hot path, in one run.

    .venv/bin/python benchmarks/bench_recovery.py [--rounds 5] [--layers 4] [--calls 2000]
        [--backends mp,ray] [--mp-start-method forkserver]

Back after a death, on ``mp`` TP 2 and ``ray`` TP 2, with the reference model large enough
that loading it takes visible time (a checkpoint of ``--layers`` layers, about 80 MB a
layer, written once into a temporary directory), interleaved in rounds:

* ``rank replacement``: an executor with ``RecoveryPolicy(backoff_s=0)``; rank 1's process
  is killed (SIGKILL) and the clock runs from the kill to the first call that succeeds (a
  call made at once, retried while it fails with the death). Rank 0 keeps its process and
  weights: its ``load_model`` calls are counted (target 0).
  The rank runs in a warm spare (``spare_workers=1``, the default: on ``mp`` the node's
  idle process, on ``ray`` an idle actor on the driver's node); ``rank replacement, no
  spare`` is the same with ``spare_workers=0`` (a new process or actor).
* ``group restart``: the same with ``replace_ranks=False``: every rank starts again.
* ``new executor`` (the baseline): from ``shutdown()`` of a running executor to the first
  call of a new one with the same config (what an engine without recovery does).

Targets: the replacement at most 0.5x the new executor, the restart at most 1.1x (medians
over ``--rounds``). Before each timing the machine settles (this process's children use
less than a fifth of a core): a spare started after the last recovery has done its imports,
as it would have long before a real engine's next death.

Tuned by two settings, beside defaults: the policy's ``backoff_s=0`` (the default waits
before a restart), and on ``ray`` ``log_to_driver=False`` (Ray's reports of killed actors
stay off the table) and ``local_num_cpus=8`` (the executors of a round fit on a 2-core
machine's Ray; placement only). ``--mp-start-method forkserver`` is a further tuned
variant of the ``mp`` rows: workers forked from a forkserver that has imported torch and the
reference model (``set_forkserver_preload``), so that a new rank skips the interpreter's start
and ``import torch``.

The hot path: a no-op ``collective_rpc`` on ``mp`` (2 workers, ``executor bench``'s worker)
with no recovery, with ``RecoveryPolicy()``, and with ``RecoveryPolicy()`` plus
``hang_timeout_s=10``, interleaved in rounds (``executor bench``'s timing loop). Target: each
within 1.05x of no recovery (median).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import psutil

from executor_bench import BenchWorker, format_time, interleave, markdown_table, percentile
from executor_core import (
    Executor,
    ExecutorConfig,
    RecoveryPolicy,
    WorkerDiedError,
    create_executor,
)
from executor_core.backend import default_registry


def _pid(worker: Any) -> int:
    return os.getpid()


def _first_success(executor: Executor, deadline_s: float) -> None:
    """Call until a call succeeds (a call sent before the death was seen fails with it)."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            executor.collective_rpc(_pid, timeout=deadline_s)
            return
        except WorkerDiedError:
            if time.monotonic() > deadline:
                raise


def _settle(limit_s: float = 30.0) -> None:
    """Wait until this process's children (workers, spares, Ray's processes) use less than a
    fifth of a core over half a second, or ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        before = _children_cpu_s()
        time.sleep(0.5)
        if _children_cpu_s() - before < 0.1:
            return


def _children_cpu_s() -> float:
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            times = child.cpu_times()
            total += times.user + times.system
    return total


def _reference_config(
    backend: str,
    checkpoint: Path,
    recovery: RecoveryPolicy | None,
    start_method: str,
    spares: bool = True,
) -> Any:
    options: dict[str, Any] = {}
    if backend == "ray":
        # Ray's raylet reports every killed actor on the driver's stderr: kept out of the table.
        # 8 logical CPUs: the executors of a round fit a 2-core machine's Ray (placement only).
        options = {"log_to_driver": False, "local_num_cpus": 8}
    elif start_method != "spawn":
        options = {"start_method": start_method}
    if not spares:
        options["spare_workers"] = 0
    return ExecutorConfig(
        backend=backend,
        worker_cls="executor_reference:ReferenceWorker",
        worker_kwargs={"checkpoint": str(checkpoint), "kv_slots": 4, "cpu_threads": 1},
        tensor_parallel_size=2,
        recovery=recovery,
        backend_options=options,
    )


def _loads(worker: Any) -> int:
    return int(worker.model_loads)


def bench_back(
    backend: str, checkpoint: Path, rounds: int, start_method: str = "spawn"
) -> dict[str, list[float]]:
    """Seconds from a SIGKILL to the first good call (rank replacement, group restart), and
    from shutdown to a new executor's first call (new executor), interleaved in rounds. Also
    the survivors' load_model calls during the replacements (``"survivor loads"``)."""
    replace = RecoveryPolicy(max_restarts=rounds + 2, backoff_s=0.0)
    restart = attrs.evolve(replace, replace_ranks=False)
    times: dict[str, list[float]] = {"rank replacement": []}
    replacers = {"rank replacement": _reference_config(backend, checkpoint, replace, start_method)}
    if backend in ("mp", "ray"):
        times["rank replacement, no spare"] = []
        replacers["rank replacement, no spare"] = _reference_config(
            backend, checkpoint, replace, start_method, spares=False
        )
    times.update({"group restart": [], "new executor": [], "survivor loads": []})
    executors = {label: create_executor(config) for label, config in replacers.items()}
    replacing = executors["rank replacement"]
    restarting = create_executor(_reference_config(backend, checkpoint, restart, start_method))
    executors["group restart"] = restarting
    try:
        for executor in executors.values():
            _first_success(executor, 300)
        for _ in range(rounds):
            for label, executor in executors.items():
                pids = executor.collective_rpc(_pid, timeout=300)
                _settle()
                start = time.perf_counter()
                os.kill(pids[1], signal.SIGKILL)
                _first_success(executor, 300)
                times[label].append(time.perf_counter() - start)
            loads = replacing.collective_rpc(_loads, timeout=300)
            times["survivor loads"].append(float(loads[0] - 1))
            _settle()
            start = time.perf_counter()
            restarting.shutdown()
            restarting = create_executor(
                _reference_config(backend, checkpoint, restart, start_method)
            )
            executors["group restart"] = restarting
            _first_success(restarting, 300)
            times["new executor"].append(time.perf_counter() - start)
    finally:
        for executor in executors.values():
            executor.shutdown()
    return times


def bench_hot(calls: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per no-op call on mp with recovery off, on, and on with a hang bound."""
    configs = {
        "no recovery": {},
        "RecoveryPolicy()": {"recovery": RecoveryPolicy()},
        "RecoveryPolicy() + hang_timeout_s=10": {
            "recovery": RecoveryPolicy(),
            "hang_timeout_s": 10.0,
        },
    }
    executors = {
        label: create_executor(
            ExecutorConfig(backend="mp", worker_cls=BenchWorker, tensor_parallel_size=2, **extra)
        )
        for label, extra in configs.items()
    }
    try:
        _settle()  # the spares of the executors with a policy have done their imports
        sides = {
            label: (lambda executor=executor: executor.collective_rpc("noop"))
            for label, executor in executors.items()
        }
        return interleave(sides, rounds, calls // rounds, warmup=200)
    finally:
        for executor in executors.values():
            executor.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--backends", default="mp,ray")
    parser.add_argument(
        "--mp-start-method",
        choices=("spawn", "forkserver"),
        default="spawn",
        help="mp's start_method (forkserver: tuned, with torch preloaded in the forkserver)",
    )
    args = parser.parse_args()
    if args.mp_start_method == "forkserver":
        multiprocessing.get_context("forkserver").set_forkserver_preload(
            ["torch", "executor_reference"]
        )
    from executor_reference import ModelConfig, ensure_checkpoint

    installed = {spec.name for spec in default_registry().backends()}
    model = ModelConfig(
        vocab_size=8192,
        hidden_size=1024,
        num_layers=args.layers,
        num_heads=16,
        intermediate_size=4096,
    )
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
        checkpoint = ensure_checkpoint(model, tmp)
        size_mb = checkpoint.stat().st_size / 1e6
        print(f"checkpoint: {size_mb:.0f} MB ({args.layers} layers)\n")
        rows = []
        tuned = " (forkserver)" if args.mp_start_method == "forkserver" else ""
        for backend in args.backends.split(","):
            if backend not in installed:
                print(f"skip {backend}: not installed", file=sys.stderr)
                continue
            times = bench_back(backend, checkpoint, args.rounds, args.mp_start_method)
            loads = times.pop("survivor loads")
            print(f"{backend}: survivors' load_model calls in the replacements: {sum(loads):g}")
            base = statistics.median(times["new executor"])
            for label, samples in times.items():
                median = statistics.median(samples)
                rows.append(
                    [
                        f"{backend} TP 2{tuned if backend == 'mp' else ''}",
                        label,
                        f"{median:.2f} s",
                        f"{min(samples):.2f}-{max(samples):.2f} s",
                        f"{median / base:.2f}x",
                    ]
                )
            # Each backend's rows as soon as they are measured (the next may fail to start).
            print(
                markdown_table(["layout", "back after", "median", "range", "/ new executor"], rows)
            )
    print()
    hot = bench_hot(args.calls, 10)
    base = statistics.median(hot["no recovery"])
    hot_rows = [
        [
            label,
            format_time(statistics.median(samples)),
            format_time(percentile(samples, 0.99)),
            f"{statistics.median(samples) / base:.3f}x",
        ]
        for label, samples in hot.items()
    ]
    print(markdown_table(["mp no-op, 2 workers", "median", "p99", "/ no recovery"], hot_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
