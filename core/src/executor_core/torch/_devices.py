"""How many GPUs a node's workers will see, and the rule that each local rank gets its own."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from .._errors import ConfigError

__all__ = ["check_gpu_per_local_rank", "visible_gpu_count"]


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
    see on this node.

    Counted without initialising CUDA in this process, so that it may still fork. When
    ``env`` sets ``CUDA_VISIBLE_DEVICES``, its entries are counted (each names a device the
    worker must find; a wrong one fails in the worker's ``select_device``).
    """
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
    where = (
        f"CUDA_VISIBLE_DEVICES={(env or {})['CUDA_VISIBLE_DEVICES']!r} in config.env"
        if "CUDA_VISIBLE_DEVICES" in (env or {})
        else (
            f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r}"
            if "CUDA_VISIBLE_DEVICES" in os.environ
            else f"torch {torch.__version__}"
        )
    )
    raise ConfigError(
        "device",
        "cuda",
        f"{local_ranks} worker{'s' if local_ranks != 1 else ''} on this node "
        f"need{'' if local_ranks != 1 else 's'} a GPU each, but {count} "
        f"{'is' if count == 1 else 'are'} visible ({where}); lower tensor_parallel_size * "
        "pipeline_parallel_size, make more GPUs visible, or use device='cpu'",
    )
