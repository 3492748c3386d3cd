"""The check of scripts/gpu_check.py that a death during a NCCL collective is recovered:
``recovery_nccl``. On two GPUs, mp at tp=2 runs NCCL all_reduces in one long call; rank 1's
process is killed (SIGKILL) in the middle. A survivor blocked in a NCCL collective with a dead
peer does not return by itself (NCCL waits for its watchdog's timeout), so the call must fail
from the driver's side, the group restart must stop the survivor by force (which frees its
GPU), and the executor must come back and compute the main job's tokens as on the CPU."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from _gpu_common import CALL_TIMEOUT_S, Context, Outcome, judge

#: Seconds from the kill within which the call in flight must fail, and within which the
#: executor must be back.
FAIL_WITHIN_S = 15.0
BACK_WITHIN_S = 120.0


def _pid(worker: Any) -> int:
    return os.getpid()


def _all_reduce_for(worker: Any, seconds: float) -> int:
    """NCCL (or gloo) all_reduces on the worker's group for ``seconds``: the call the kill
    interrupts."""
    import torch
    import torch.distributed as dist

    tensor = torch.ones(1 << 20, device=worker.state.device)
    rounds = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        dist.all_reduce(tensor)
        rounds += 1
    if tensor.is_cuda:
        torch.cuda.synchronize()
    return rounds


def check_recovery_nccl(ctx: Context) -> Outcome:
    from _gpu_tokens import compare_tokens, main_job, main_job_config

    from executor_core import ExecutorState, RecoveryPolicy, WorkerDiedError, create_executor

    config = main_job_config(
        ctx, backend="mp", device=ctx.device, tp=2, recovery=RecoveryPolicy(backoff_s=0.0)
    )
    problems: list[str] = []
    figures: dict[str, Any] = {}
    with create_executor(config) as executor:
        pids = executor.collective_rpc(_pid, timeout=CALL_TIMEOUT_S)
        future = executor.collective_rpc(_all_reduce_for, args=(30.0,), non_block=True)
        time.sleep(2.0)  # well inside the collectives
        killed = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        try:
            error = future.exception(timeout=FAIL_WITHIN_S)
        except TimeoutError:
            error = None
            problems.append(f"the call in flight still waits {FAIL_WITHIN_S:g} s after the kill")
        figures["call_failed_after_s"] = time.monotonic() - killed
        if error is not None and not (isinstance(error, WorkerDiedError) and 1 in error.ranks):
            problems.append(f"the call failed with {error!r}, not a WorkerDiedError naming rank 1")
        while executor.state is not ExecutorState.RUNNING:
            if time.monotonic() - killed > BACK_WITHIN_S or executor.state is ExecutorState.FAILED:
                problems.append(f"not back: state {executor.state}, {executor.failure!r}")
                break
            time.sleep(0.05)
        figures["back_after_s"] = time.monotonic() - killed
        record = executor.last_recovery
        figures["kind"] = record.kind if record is not None else None
        survivor = pids[0]
        figures["survivor_stopped"] = not os.path.exists(f"/proc/{survivor}")
        # A survivor blocked in NCCL never reaches the rejoin call, so the rank replacement
        # falls back to a group restart, which must stop it; one that did rejoin (its
        # collective returned) keeps its process.
        if figures["kind"] == "replace" and figures["survivor_stopped"]:
            problems.append(f"the rank replacement stopped the survivor (pid {survivor})")
        if figures["kind"] != "replace" and not figures["survivor_stopped"]:
            problems.append(f"the survivor (pid {survivor}) blocked in NCCL was not stopped")
        if not problems:
            tokens = compare_tokens(
                main_job(ctx, backend="uni", device="cpu"),
                main_job(ctx, backend="mp", device=ctx.device, tp=2, executor=executor),
                "after the recovery: mp tp=2 vs uni cpu",
            )
            figures.update(tokens.figures)
            if tokens.status != "PASS":
                problems.append(tokens.summary)
    summary = (
        f"killed rank 1 mid-all_reduce: the call failed after {figures['call_failed_after_s']:.2f} "
        f"s, back after {figures.get('back_after_s', float('nan')):.1f} s "
        f"({figures.get('kind')}), same tokens"
    )
    return judge(summary, problems, figures)
