"""The table of scripts/gpu_check.py's checks (what each verifies, its time limit, when it is
skipped) and the entry that runs one of them in the process gpu_check.py starts for it.

The checks themselves: _gpu_tokens.py (the same tokens), _gpu_worker.py (sleep's memory, the
step clock), _gpu_devices.py (each rank's GPU, the placements refused) and _gpu_probe.py.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import traceback
from collections.abc import Callable
from pathlib import Path

from _gpu_common import FAIL, NO_RAY, Context, Outcome, describe
from _gpu_devices import (
    check_device_per_thread_mp,
    check_device_per_thread_ray,
    check_device_per_thread_uni,
    check_fork_after_cuda,
    check_one_gpu_per_rank,
)
from _gpu_probe import Env, probe
from _gpu_recovery import check_recovery_nccl
from _gpu_tokens import check_tokens, check_tokens_tp2
from _gpu_worker import check_sleep_wake, check_timing


def _anywhere(_env: Env) -> str | None:
    return None


def _needs_gpu(env: Env) -> str | None:
    return None if env.gpu else "no GPU (dry run): needs CUDA"


def _needs_two_gpus(env: Env) -> str | None:
    if not env.gpu:
        return "no GPU (dry run): covered by tokens (mp tp=2 cpu)"
    return None if env.gpu_count >= 2 else f"needs two GPUs, {env.gpu_count} visible"


def _needs_two_gpus_cpu_elsewhere(env: Env) -> str | None:
    if not env.gpu:
        return "no GPU (dry run): the group restart on cpu is tests/test_reference_backends.py's"
    return None if env.gpu_count >= 2 else f"needs two GPUs, {env.gpu_count} visible"


def _needs_ray(env: Env) -> str | None:
    return None if env.ray_installed else NO_RAY


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    #: What it checks, for --list.
    title: str
    run: Callable[[Context], Outcome]
    #: Seconds the check may take (its process is stopped after that).
    limit_s: float
    #: Why the check does not run on this machine, or None when it does.
    skip: Callable[[Env], str | None] = _anywhere


PROBE = Check("probe", "the machine: versions, GPUs, backends", probe, 60.0)

#: In the order they run; fork_after_cuda last (it initialises CUDA in its driver).
CHECKS: tuple[Check, ...] = (
    Check("tokens", "same greedy tokens on cuda as on cpu (uni)", check_tokens, 90.0),
    Check(
        "tokens_tp2",
        "same greedy tokens with mp tp=2 on two GPUs as on cpu",
        check_tokens_tp2,
        90.0,
        _needs_two_gpus,
    ),
    Check(
        "sleep_wake",
        "sleep frees the device memory, wake_up takes it back, same tokens",
        check_sleep_wake,
        75.0,
    ),
    Check(
        "timing",
        "the worker's model time agrees with the synchronized step time",
        check_timing,
        75.0,
    ),
    Check(
        "device_per_thread_uni",
        "uni: a call on the runner thread sees the worker's GPU",
        check_device_per_thread_uni,
        45.0,
    ),
    Check("device_per_thread_mp", "mp: rank r's calls see GPU r", check_device_per_thread_mp, 75.0),
    Check(
        "device_per_thread_ray",
        "ray: each actor's calls see its GPU",
        check_device_per_thread_ray,
        100.0,
        _needs_ray,
    ),
    Check(
        "one_gpu_per_rank",
        "more ranks than GPUs: ConfigError before any worker starts",
        check_one_gpu_per_rank,
        45.0,
    ),
    Check(
        "recovery_nccl",
        "mp tp=2: rank 1 killed mid-NCCL all_reduce; the call fails, the group restarts",
        check_recovery_nccl,
        150.0,
        _needs_two_gpus_cpu_elsewhere,
    ),
    Check(
        "fork_after_cuda",
        "mp refuses start_method=fork after CUDA is initialised in the driver",
        check_fork_after_cuda,
        45.0,
        _needs_gpu,
    ),
)

BY_NAME = {check.name: check for check in (PROBE, *CHECKS)}


def run_here(check: Check, ctx: Context, result_path: Path) -> int:
    """Run ``check`` in this (child) process and write its outcome to ``result_path``."""

    def stop(_signum: int, _frame: object) -> None:
        # The parent's time limit: unwind, so that every executor's `with` shuts it down.
        raise KeyboardInterrupt(f"{check.name}: stopped at its time limit")

    signal.signal(signal.SIGTERM, stop)
    try:
        outcome = check.run(ctx)
    except Exception as exc:  # noqa: BLE001 - every error is the check's failure, reported
        traceback.print_exc()
        outcome = Outcome(FAIL, describe(exc), {"traceback": traceback.format_exc()})
    result_path.write_text(json.dumps(dataclasses.asdict(outcome), default=str))
    return 0
