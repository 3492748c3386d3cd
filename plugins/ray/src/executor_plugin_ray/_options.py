"""RayOptions: the ``backend_options`` keys the Ray backend understands, validated."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from executor_channel import ChannelOptions
from executor_core.options import (
    boolean,
    integer,
    number,
    one_of,
    option,
    optional,
    text,
)

__all__ = ["PLACEMENT_STRATEGIES", "RayOptions"]

_MIB = 1 << 20

#: Placement-group strategies Ray offers (PACK is the default).
PLACEMENT_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")


def _resources(value: Any) -> dict[str, float]:
    """Custom resources per worker: name -> amount > 0 (CPU and GPU have keys of their own)."""
    if not isinstance(value, Mapping):
        raise ValueError("must be a dict of resource name -> amount")
    amount_check = number(above=0.0)
    resources: dict[str, float] = {}
    for name, amount in value.items():
        if not isinstance(name, str) or not name:
            raise ValueError("must have non-empty strings as resource names")
        if name in ("CPU", "GPU"):
            raise ValueError(
                f"must not hold {name}: set it through 'num_cpus_per_worker' or "
                "ExecutorConfig.device"
            )
        try:
            resources[name] = amount_check(amount)
        except ValueError as exc:
            raise ValueError(f"[{name!r}] {exc}") from None
    return resources


@attrs.frozen(kw_only=True)
class RayOptions(ChannelOptions):
    """What ``ExecutorConfig.backend_options`` may hold for ``backend="ray"``.

    Every key is optional; see the distribution's README for the user-facing table.
    ``RayExecutor.options_cls``: the core refuses any other key.
    """

    #: Ray cluster to connect to ("auto", "host:port", "ray://...") when this process is not
    #: connected to Ray yet (a connection it has is used as it is); default: $RAY_ADDRESS,
    #: else a new local instance. See ``_cluster.acquire_ray``.
    address: str | None = option(None, optional(text()))
    #: Logical CPUs reserved per worker in its placement-group bundle.
    num_cpus_per_worker: float = option(1.0, number(at_least=0.0))
    #: Custom Ray resources reserved per worker (e.g. ``{"accelerator_x": 1}``).
    resources_per_worker: dict[str, float] = option({}, _resources)
    #: Placement-group strategy: PACK, STRICT_PACK, SPREAD or STRICT_SPREAD.
    placement_strategy: str = option("PACK", one_of(*PLACEMENT_STRATEGIES, upper=True))
    #: Seconds to wait for the placement group before failing with what is missing.
    placement_timeout: float = option(60.0, number(above=0.0))
    #: Seconds to wait for the actors to start and run init_device + load_model.
    startup_timeout: float = option(600.0, number(above=0.0))
    #: Logical CPUs of a local instance this backend starts (default: the machine's count).
    local_num_cpus: float | None = option(None, optional(number(at_least=0.0)))
    #: GPUs of a local instance this backend starts (default: Ray's detection).
    local_num_gpus: float | None = option(None, optional(number(at_least=0.0)))
    #: Directory for a local instance's files (default: a fresh temp dir, removed at the end).
    temp_dir: str | None = option(None, optional(text()))
    #: Forward the actors' stdout/stderr to this process (a local instance only).
    log_to_driver: bool = option(True, boolean())
    #: With a recovery policy: idle actors on the driver's node, the worker class's module
    #: imported, for a rank replacement to take instead of starting an actor (``_spare``).
    #: 0: none. Ignored with ``resources_per_worker``.
    spare_workers: int = option(1, integer(at_least=0, at_most=64))
