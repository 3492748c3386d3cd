"""Devices: how many GPUs a node's workers will see, the rule that each local rank gets its
own, and the device (and collective backend) a worker takes."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .._errors import ConfigError

if TYPE_CHECKING:
    from .._worker import WorkerContext

__all__ = ["check_gpu_per_local_rank", "select_device", "visible_gpu_count"]


def _visible_entries(value: str) -> int:
    """Devices a ``CUDA_VISIBLE_DEVICES`` value names: CUDA stops at the first empty or
    negative entry."""
    count = 0
    for entry in value.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        count += 1
    return count


def visible_gpu_count(env: Mapping[str, str] | None = None) -> int:
    """GPUs a worker process started with ``env`` (added to this process's environment) will
    see on this node, counted without initialising CUDA here (so that it may still fork):
    ``env``'s ``CUDA_VISIBLE_DEVICES`` entries, if it sets them."""
    if not torch.cuda.is_available():
        return 0
    visible = (env or {}).get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return _visible_entries(visible)
    return int(torch.cuda.device_count())


def check_gpu_per_local_rank(local_ranks: int, env: Mapping[str, str] | None = None) -> None:
    """Raise :class:`~executor_core.ConfigError` unless the GPUs visible to workers started
    here with ``env`` give each of ``local_ranks`` ranks a GPU of its own.

    For launchers that start a node's workers themselves, before any starts: two ranks on one
    GPU fail at their first NCCL collective ("duplicate GPU"), or hang.
    """
    count = visible_gpu_count(env)
    if count >= local_ranks:
        return
    where = f"torch {torch.__version__}"
    for values, source in ((os.environ, ""), (env or {}, " in config.env")):  # env wins
        if "CUDA_VISIBLE_DEVICES" in values:
            where = f"CUDA_VISIBLE_DEVICES={values['CUDA_VISIBLE_DEVICES']!r}{source}"
    raise ConfigError(
        "device",
        "cuda",
        f"{local_ranks} worker{'s' if local_ranks != 1 else ''} on this node "
        f"need{'' if local_ranks != 1 else 's'} a GPU each, but {count} "
        f"{'is' if count == 1 else 'are'} visible ({where}); lower tensor_parallel_size * "
        "pipeline_parallel_size, make more GPUs visible, or use device='cpu'",
    )


def select_device(context: WorkerContext) -> torch.device:
    """This worker's device: the CPU, or the GPU of its local rank (made current).

    On CUDA the worker takes ``cuda:{local_rank}`` of the GPUs it sees, and refuses a local
    rank with no GPU of its own. One exception: a process whose ``CUDA_VISIBLE_DEVICES``
    names a single GPU was given it by its launcher, and takes it whatever its local rank.
    """
    if context.device == "cpu":
        return torch.device("cpu")
    if context.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                "device='cuda' but this torch build sees no GPU "
                f"(torch {torch.__version__}); use device='cpu' or install a CUDA build"
            )
        count = torch.cuda.device_count()
        # CUDA_VISIBLE_DEVICES naming one device: the launcher gave this process a GPU of its
        # own (Slurm's --gpus-per-task=1, say).
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
        narrowed = count == 1 and len([entry for entry in visible if entry.strip()]) == 1
        index = 0 if narrowed else context.local_rank
        if index >= count:
            raise RuntimeError(
                f"local rank {context.local_rank} of {context.local_world_size} on this node "
                f"has no GPU of its own: {count} visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
                "start at most one worker per GPU"
            )
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(context.device, context.local_rank)


def _dist_backend(device: torch.device) -> str:
    known = {"cpu": "gloo", "cuda": "nccl"}.get(device.type)  # else torch knows
    if known is not None:
        return known
    lookup = getattr(dist, "get_default_backend_for_device", None)  # torch 2.6 and later
    if lookup is not None:
        return str(lookup(device))
    # Earlier torch: the map that lookup reads, which a device's plugin fills when it
    # registers its collective backend.
    backend = dist.Backend.default_device_backend_map.get(device.type)
    if backend is None:
        raise ValueError(
            f"no torch.distributed backend is registered for {device.type!r} devices "
            f"(torch {torch.__version__}); import the device's torch plugin first"
        )
    return str(backend)


def _check_reused_backend(backend: str, device: torch.device) -> None:
    """Refuse a process group the user made whose backend cannot carry this device's
    tensors (gloo has no CUDA send/recv)."""
    if device.type != "cuda":
        return
    per_device = dict(part.split(":", 1) for part in backend.split(",") if ":" in part)
    cuda_backend = per_device.get("cuda", backend if not per_device else "")
    if cuda_backend in ("", "gloo"):
        raise RuntimeError(
            f"this process already joined a process group with backend {backend!r}, which "
            "cannot carry CUDA tensors, but the worker's device is cuda; initialise it with "
            "backend='nccl' (or 'cpu:gloo,cuda:nccl'), or use device='cpu'"
        )
