"""The built-in rule for ``backend="auto"``, registered like any plugin and run last."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ._hookspecs import hookimpl

if TYPE_CHECKING:
    from ._config import ExecutorConfig

__all__ = ["executor_select_backend", "ray_is_initialized"]


def ray_is_initialized() -> bool:
    """True if this process already connected to Ray. Never imports Ray itself."""
    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized())


@hookimpl(trylast=True)
def executor_select_backend(config: ExecutorConfig, available: Sequence[str]) -> str | None:
    """Several nodes or a live Ray session: ``ray``; one worker: ``uni``; else ``mp``."""
    if (config.num_nodes > 1 or ray_is_initialized()) and "ray" in available:
        return "ray"
    if config.num_nodes > 1:
        return None  # only a multi-node backend will do; the caller explains what to install
    if config.world_size == 1 and "uni" in available:
        return "uni"
    if "mp" in available:
        return "mp"
    return None
