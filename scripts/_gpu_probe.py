"""The environment probe of scripts/gpu_check.py: the versions, GPUs, NCCL and backends that a
run found, where the SDK was imported from, and the mode (GPU run or dry run) they make."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import platform
from pathlib import Path
from typing import Any

from _gpu_common import PASS, Context, Outcome


@dataclasses.dataclass(frozen=True)
class Env:
    """The machine as the probe saw it, in the mode the run chose: what decides a SKIP."""

    gpu: bool
    gpu_count: int
    ray_installed: bool


def probe(_ctx: Context) -> Outcome:
    """The environment: versions, GPUs, installed backends (run in a process of its own)."""
    import torch

    import executor_core
    from executor_core.backend import default_registry

    available = bool(torch.cuda.is_available())
    count = int(torch.cuda.device_count()) if available else 0
    gpus: list[dict[str, Any]] = [
        {
            "name": props.name,
            "total_bytes": int(props.total_memory),
            "capability": f"{props.major}.{props.minor}",
        }
        for props in map(torch.cuda.get_device_properties, range(count))
    ]
    figures: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": available,
        "gpu_count": count,
        "gpus": gpus,
        "executor_core": executor_core.__version__,
        # Where the SDK was imported from: the bundle's folder on a machine set up offline.
        "executor_core_path": str(Path(executor_core.__file__).parent),
        "backends": sorted(spec.name for spec in default_registry().backends()),
        "ray_installed": importlib.util.find_spec("ray") is not None,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    if available:
        with contextlib.suppress(Exception):  # some builds have no NCCL
            nccl: Any = torch.cuda.nccl  # version() carries no type information
            figures["nccl"] = ".".join(str(v) for v in nccl.version())
    names = ", ".join(sorted({g["name"] for g in gpus})) or "no GPU"
    return Outcome(
        PASS,
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), {count} GPU(s): {names}; "
        f"Python {figures['python']}; executor_core {executor_core.__version__} from "
        f"{figures['executor_core_path']}; backends {', '.join(figures['backends'])}",
        figures,
    )


def choose_mode(passed: bool, figures: dict[str, Any], dry_run: bool) -> tuple[Env, str | None]:
    """The run's environment from the probe's figures (``passed``: it ran), and why it is a
    dry run (None for a GPU run)."""
    count = int(figures.get("gpu_count", 0)) if figures.get("cuda_available") else 0
    ray = bool(figures.get("ray_installed", False))
    if dry_run:
        reason: str | None = "--dry-run"
    elif not passed:
        reason = "the probe failed"
    else:
        reason = None if count > 0 else "no GPU is visible to torch"
    return Env(reason is None, count if reason is None else 0, ray), reason
