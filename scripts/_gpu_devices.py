"""The checks of scripts/gpu_check.py on which GPU a rank uses: ``device_per_thread_*`` (a call
on another thread than the one that set the worker up sees the worker's GPU, on uni, mp and
Ray), and the placements CUDA cannot run, refused before a worker starts:
``one_gpu_per_rank`` (more ranks than GPUs) and ``fork_after_cuda`` (mp's fork once CUDA is
initialised in the driver)."""

from __future__ import annotations

import multiprocessing.process
import os
import sys
import time
from typing import TYPE_CHECKING, Any
from unittest import mock

from _gpu_common import (
    CALL_TIMEOUT_S,
    FAIL,
    NO_RAY,
    SKIP,
    STARTUP_TIMEOUT_S,
    Context,
    Outcome,
    cuda_count,
    describe,
    judge,
    reference_config,
    reference_model,
)

if TYPE_CHECKING:
    from executor_core import ExecutorConfig

#: A forbidden configuration is refused by a check of the config, at once: an error that
#: comes only after a wait (a start-up timeout) does not count.
MAX_REFUSAL_S = 10.0
#: The worker of the configurations that must be refused: if one starts anyway, it starts
#: fast and touches no GPU (the conformance kit's).
IDLE_WORKER = "executor_core.testing:ConformanceWorker"


def _thread_probe(worker: Any) -> dict[str, Any]:
    """Runs on the worker: which thread runs the call, and the device current on it."""
    import threading

    import torch

    thread = threading.current_thread()
    device = worker.state.device
    info: dict[str, Any] = {
        "rank": worker.rank,
        "thread": thread.name,
        "main_thread": thread is threading.main_thread(),
        "device": str(device),
        "pid": os.getpid(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    if device.type == "cuda":
        info["expected_device"] = device.index
        info["current_device"] = torch.cuda.current_device()
    return info


def _device_per_thread(ctx: Context, backend: str, tp: int) -> Outcome:
    """PASS when every rank's call saw the rank's own device as current (on a GPU), or, on
    the CPU, reached the worker on the path that the GPU run takes (on uni: its runner
    thread, not the caller's)."""
    import cloudpickle

    from executor_core import create_executor

    # The probe crosses to mp's and Ray's workers by value: they need not find scripts/.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # A default timeout sends every call through the backend's call path (on uni: its runner
    # thread) instead of a plain method call on the caller's thread.
    config = reference_config(
        ctx, reference_model("small"), backend=backend, tp=tp, rpc_timeout=CALL_TIMEOUT_S
    )
    try:
        executor = create_executor(config)
    except Exception as exc:  # Ray that cannot start here is a SKIP, by design
        if backend != "ray":
            raise
        return Outcome(SKIP, f"Ray did not start: {describe(exc)}")
    with executor:
        infos: list[dict[str, Any]] = executor.collective_rpc(_thread_probe)
    problems: list[str] = []
    seen: list[str] = []
    for info in infos:
        seen.append(f"rank {info['rank']} on thread {info['thread']!r}: ")
        if "current_device" in info:
            seen[-1] += f"current cuda:{info['current_device']}, worker's {info['device']}"
            if info["current_device"] != info["expected_device"]:
                problems.append(f"rank {info['rank']} saw the wrong device")
        else:
            seen[-1] += info["device"]
        if backend == "uni" and info["main_thread"]:
            problems.append(f"rank {info['rank']}: the call ran on the main thread, not a runner")
    ranks = [info["rank"] for info in infos]
    if ranks != list(range(len(infos))):
        problems.append(f"replies from ranks {ranks}")
    label = f"{'' if ctx.gpu else 'dry run: '}{backend} tp={tp} {ctx.device}, rpc_timeout set"
    summary = f"{label}: " + "; ".join(seen)
    if ctx.gpu and cuda_count() == 1:
        summary += " (one GPU: device 0 is every thread's default, so this proves the call path"
        summary += " only)"
    return judge(summary, problems, {"ranks": infos})


def check_device_per_thread_uni(ctx: Context) -> Outcome:
    return _device_per_thread(ctx, "uni", 1)


def check_device_per_thread_mp(ctx: Context) -> Outcome:
    # rank r on GPU r: two ranks where there are two GPUs (the dry run: two on the CPU).
    return _device_per_thread(ctx, "mp", min(2, cuda_count()) if ctx.gpu else 2)


def check_device_per_thread_ray(ctx: Context) -> Outcome:
    try:
        import ray  # noqa: F401 - only asks whether Ray is installed
    except ImportError as exc:
        return Outcome(SKIP, f"{NO_RAY}: {exc}")
    # On the CPU one actor: the dry run proves the path, and a second one costs seconds.
    return _device_per_thread(ctx, "ray", min(2, cuda_count()) if ctx.gpu else 1)


def _expect_refusal(config: ExecutorConfig, label: str, word: str) -> Outcome:
    """PASS when create_executor raises ConfigError mentioning ``word`` at once, before a
    worker process starts (the processes multiprocessing starts meanwhile are counted)."""
    from executor_core import ConfigError, create_executor

    started: list[str] = []
    original = multiprocessing.process.BaseProcess.start

    def start(self: multiprocessing.process.BaseProcess) -> None:
        started.append(self.name)
        original(self)

    began = time.perf_counter()
    with mock.patch.object(multiprocessing.process.BaseProcess, "start", start):
        try:
            with create_executor(config) as executor:
                elapsed = time.perf_counter() - began
                executor.collective_rpc("check_health", timeout=CALL_TIMEOUT_S)
            return Outcome(
                FAIL,
                f"{label}: no error; the executor started {len(started)} worker(s) in "
                f"{elapsed:.2f} s",
                {"seconds": elapsed, "processes_started": len(started)},
            )
        except Exception as exc:  # noqa: BLE001 - judged below: only a ConfigError passes
            error, elapsed = exc, time.perf_counter() - began
    figures = {"error": str(error), "seconds": elapsed, "processes_started": len(started)}
    if not isinstance(error, ConfigError):
        return Outcome(
            FAIL,
            f"{label}: raised {type(error).__name__}, not ConfigError, after {elapsed:.2f} s "
            f"and {len(started)} worker start(s): {str(error).strip()[:300]}",
            figures,
        )
    problems = []
    if word.lower() not in str(error).lower():
        problems.append(f"the message does not mention {word!r}")
    if started:
        problems.append("worker processes were started first")
    if elapsed > MAX_REFUSAL_S:
        problems.append(f"it took more than {MAX_REFUSAL_S:.0f} s")
    said = f"{label}: ConfigError after {elapsed:.2f} s, {len(started)} worker(s) started"
    return judge(f"{said}: {error}", problems, figures)


def check_one_gpu_per_rank(ctx: Context) -> Outcome:
    from executor_core import ExecutorConfig

    count = cuda_count()  # without a GPU: one rank on none, refused the same way
    config = ExecutorConfig(
        backend="mp",
        worker_cls=IDLE_WORKER,
        tensor_parallel_size=count + 1,
        device="cuda",
        backend_options={"startup_timeout": STARTUP_TIMEOUT_S},
    )
    return _expect_refusal(config, f"mp cuda tp={count + 1} on {count} GPU(s)", "GPU")


def check_fork_after_cuda(ctx: Context) -> Outcome:
    import torch

    from executor_core import ExecutorConfig

    cuda: Any = torch.cuda  # init and is_initialized carry no type information
    cuda.init()
    if not cuda.is_initialized():
        return Outcome(FAIL, "torch.cuda.init() did not initialise CUDA in the driver")
    config = ExecutorConfig(
        backend="mp",
        worker_cls=IDLE_WORKER,
        device="cuda",
        backend_options={"start_method": "fork", "startup_timeout": STARTUP_TIMEOUT_S},
    )
    return _expect_refusal(config, "mp start_method=fork after torch.cuda.init()", "fork")
