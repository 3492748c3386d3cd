"""The ``recovery`` workload: back after a SIGKILL against a new executor, and recovery's cost
on the hot path.

Back after a death, on ``mp`` and ``ray`` TP 2 (those measured), with the reference model
large enough that loading it takes visible time (:data:`LAYERS` layers, about 80 MB each,
written once to a temporary directory), in interleaved rounds: rank 1's process is killed
and the clock runs to the first call that succeeds, with ``RecoveryPolicy(backoff_s=0)``
(``rank replacement``, in the warm spare; ``no spare``: ``spare_workers=0``) and with
``replace_ranks=False`` (``group restart``); against ``shutdown()`` of a running executor to
a new one's first call (``new executor``, what an engine without recovery does). Rank 0's
``load_model`` calls are counted (0: survivors reload nothing). Before each timing the
machine settles (the children use under a fifth of a core): a spare has done its imports.
**Tuned:** ``backoff_s=0``; on ``ray`` ``log_to_driver=False`` and ``local_num_cpus=8``.

The hot path: an ``mp`` no-op (2 workers, :class:`BenchWorker`) with no recovery, with
``RecoveryPolicy()``, and with it and ``hang_timeout_s=10``, interleaved.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from executor_core import Executor, ExecutorConfig, RecoveryPolicy, create_executor

from ._intervals import count
from ._result import Table
from ._selection import not_installed
from ._worker import BenchWorker
from ._workloads import format_time, interleave, percentile

__all__ = ["LAYERS", "ROUNDS", "measure", "missing"]

#: Rounds when ``--repeats`` is not given; the model's layers (``--quick``: 1).
ROUNDS = 5
LAYERS = 4
#: Targets: a rank replacement and a group restart over a new executor; the hot path's
#: no-op with recovery over without.
LIMITS = {"rank replacement": 0.5, "group restart": 1.1, "hot": 1.05}


def missing() -> str:
    """Why the workload cannot run here; empty if it can."""
    return not_installed("executor_reference", "psutil", "torch")


def _pid(worker: Any) -> int:
    return os.getpid()


def _loads(worker: Any) -> int:
    return int(worker.model_loads)


def _first_success(executor: Executor) -> None:
    """Call until a call succeeds (a call sent before the death was seen fails with it)."""
    from executor_core import WorkerDiedError

    deadline = time.monotonic() + 300
    while True:
        try:
            executor.collective_rpc(_pid, timeout=300)
            return
        except WorkerDiedError:
            if time.monotonic() > deadline:
                raise


def _settle(limit_s: float = 30.0) -> None:
    """Wait until this process's children use under a fifth of a core for 0.5 s."""
    import psutil  # type: ignore[import-untyped]  # psutil ships no type information

    def cpu_s() -> float:
        total = 0.0
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):  # it exited meanwhile
                total += sum(child.cpu_times()[:2])
        return total

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        before = cpu_s()
        time.sleep(0.5)
        if cpu_s() - before < 0.1:
            return


def _back(backend: str, checkpoint: Path, rounds: int) -> dict[str, list[float]]:
    """Seconds from a SIGKILL to the first good call, and from shutdown to a new executor's
    first call, by label, round by round; and the survivors' loads (``survivor loads``)."""
    replace = RecoveryPolicy(max_restarts=rounds + 2, backoff_s=0.0)
    restart = RecoveryPolicy(max_restarts=rounds + 2, backoff_s=0.0, replace_ranks=False)

    def config(policy: RecoveryPolicy, spares: int = 1) -> ExecutorConfig:
        options: dict[str, Any] = {"spare_workers": spares}
        if backend == "ray":  # killed actors stay off the table; a round fits 2 cores' Ray
            options |= {"log_to_driver": False, "local_num_cpus": 8}
        return ExecutorConfig(
            backend=backend,
            worker_cls="executor_reference:ReferenceWorker",
            worker_kwargs={"checkpoint": str(checkpoint), "kv_slots": 4, "cpu_threads": 1},
            tensor_parallel_size=2,
            recovery=policy,
            backend_options=options,
        )

    configs = {
        "rank replacement": config(replace),
        "rank replacement, no spare": config(replace, 0),
        "group restart": config(restart),
    }
    times: dict[str, list[float]] = {label: [] for label in [*configs, "new executor"]}
    times["survivor loads"] = []
    executors = {label: create_executor(c) for label, c in configs.items()}
    try:
        for executor in executors.values():
            _first_success(executor)
        for _ in range(rounds):
            for label, executor in executors.items():
                pids = executor.collective_rpc(_pid, timeout=300)
                _settle()
                start = time.perf_counter()
                os.kill(pids[1], signal.SIGKILL)
                _first_success(executor)
                times[label].append(time.perf_counter() - start)
            loads = executors["rank replacement"].collective_rpc(_loads, timeout=300)
            times["survivor loads"].append(float(loads[0] - 1))
            _settle()
            start = time.perf_counter()
            executors["group restart"].shutdown()
            executors["group restart"] = create_executor(configs["group restart"])
            _first_success(executors["group restart"])
            times["new executor"].append(time.perf_counter() - start)
    finally:
        for executor in executors.values():
            executor.shutdown()
    return times


def _hot(calls: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per no-op call on mp with recovery off, on, and on with a hang bound."""
    extras: dict[str, dict[str, Any]] = {
        "no recovery": {},
        "RecoveryPolicy()": {"recovery": RecoveryPolicy()},
        "RecoveryPolicy(), hang_timeout_s=10": {
            "recovery": RecoveryPolicy(),
            "hang_timeout_s": 10.0,
        },
    }
    executors = {
        label: create_executor(
            ExecutorConfig(backend="mp", worker_cls=BenchWorker, tensor_parallel_size=2, **extra)
        )
        for label, extra in extras.items()
    }
    try:
        _settle()  # the spares of the executors with a policy have done their imports
        sides = {
            label: (lambda executor=executor: executor.collective_rpc("noop"))
            for label, executor in executors.items()
        }
        return interleave(sides, rounds, calls, warmup=200)
    finally:
        for executor in executors.values():
            executor.shutdown()


def measure(rounds: int, quick: bool, backends: list[str]) -> list[Table]:
    """Back after a SIGKILL on ``mp`` and ``ray`` (of ``backends``), and the hot path."""
    from executor_reference import ModelConfig, ensure_checkpoint

    layers = 1 if quick else LAYERS
    model = ModelConfig(  # about 80 MB a layer
        vocab_size=8192, hidden_size=1024, num_layers=layers, num_heads=16, intermediate_size=4096
    )
    table = Table("recovery", "", ["layout", "back after", "median", "range", "÷ new executor"])
    loads = []
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
        checkpoint = ensure_checkpoint(model, tmp)
        size = checkpoint.stat().st_size / 1e6
        for backend in (name for name in ("mp", "ray") if name in backends):
            times = _back(backend, checkpoint, rounds)
            loads.append(f"{backend} {sum(times.pop('survivor loads')):g}")
            base = times["new executor"]
            for label, samples in times.items():
                median = statistics.median(samples)
                table.rows.append(
                    [
                        f"{backend} TP 2",
                        label,
                        f"{median:.2f} s",
                        f"{min(samples):.2f}-{max(samples):.2f} s",
                        f"{median / statistics.median(base):.2f}x",
                    ]
                )
                if label in LIMITS:
                    ratios = [a / b for a, b in zip(samples, base, strict=True)]
                    table.judge(f"{backend} {label} / a new executor", ratios, LIMITS[label])
    table.about = (
        f"Back after a SIGKILL of rank 1, to the first call that succeeds, against a new "
        f"executor; {count(rounds, 'round')}, a reference model of {layers} layers ({size:.0f} "
        "MB). **Tuned:** backoff_s=0; on ray log_to_driver=False, local_num_cpus=8. "
        f"Survivors' load_model calls in the replacements: {', '.join(loads) or '-'}."
    )
    calls, hot_rounds = (20 if quick else 200), 2 * rounds
    hot = _hot(calls, hot_rounds)
    base = hot["no recovery"]
    path = Table(
        "recovery: the hot path",
        f"mp, 2 workers, a no-op: {count(hot_rounds, 'round')} of {calls} calls.",
        ["recovery", "median", "p99", "÷ no recovery"],
    )
    for label, samples in hot.items():
        median = statistics.median(samples)
        p99 = format_time(percentile(samples, 0.99))
        ratio = median / statistics.median(base)
        path.rows.append([label, format_time(median), p99, f"{ratio:.3f}x"])
        if label != "no recovery":
            per_round = [
                statistics.median(samples[i : i + calls]) / statistics.median(base[i : i + calls])
                for i in range(0, len(base), calls)
            ]
            path.judge(f"mp no-op, {label} / no recovery", per_round, LIMITS["hot"])
    return [table, path]
