"""RayOptions: the ``backend_options`` keys the Ray backend understands, validated."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from executor_core import ConfigError

__all__ = ["PLACEMENT_STRATEGIES", "RayOptions"]

#: Placement-group strategies Ray offers (PACK is the default).
PLACEMENT_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")


def _error(key: str, value: object, allowed: str) -> ConfigError:
    return ConfigError("backend_options", {key: value}, allowed)


def _number(key: str, value: object, *, minimum: float, strict: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _error(key, value, f"{key!r} must be a number")
    if value < minimum or (strict and value == minimum):
        raise _error(key, value, f"{key!r} must be {'>' if strict else '>='} {minimum:g}")
    return float(value)


def _optional_str(key: str, value: object) -> str | None:
    if value is None or (isinstance(value, str) and value):
        return value
    raise _error(key, value, f"{key!r} must be a non-empty string or None")


def _bool(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise _error(key, value, f"{key!r} must be True or False")
    return value


def _resources(key: str, value: object) -> dict[str, float]:
    if not isinstance(value, Mapping):
        raise _error(key, value, f"{key!r} must be a dict of resource name -> amount")
    resources: dict[str, float] = {}
    for name, amount in value.items():
        if not isinstance(name, str) or not name:
            raise _error(key, value, "resource names must be non-empty strings")
        if name in ("CPU", "GPU"):
            raise _error(
                key,
                value,
                f"set {name} through 'num_cpus_per_worker' or ExecutorConfig.device, "
                "not 'resources_per_worker'",
            )
        resources[name] = _number(f"{key}[{name!r}]", amount, minimum=0.0, strict=True)
    return resources


@attrs.frozen(kw_only=True)
class RayOptions:
    """What ``ExecutorConfig.backend_options`` may hold for ``backend="ray"``.

    Every key is optional; see the distribution's README for the user-facing table.
    """

    #: Ray cluster to connect to ("auto", "host:port", "ray://...") when this process is not
    #: connected to Ray yet (a connection it has is used as it is); default: $RAY_ADDRESS,
    #: else a new local instance. See ``_cluster.acquire_ray``.
    address: str | None = None
    #: Logical CPUs reserved per worker in its placement-group bundle.
    num_cpus_per_worker: float = 1.0
    #: Custom Ray resources reserved per worker (e.g. ``{"accelerator_x": 1}``).
    resources_per_worker: dict[str, float] = attrs.field(factory=dict)
    #: Placement-group strategy: PACK, STRICT_PACK, SPREAD or STRICT_SPREAD.
    placement_strategy: str = "PACK"
    #: Seconds to wait for the placement group before failing with what is missing.
    placement_timeout: float = 60.0
    #: Seconds to wait for the actors to start and run init_device + load_model.
    startup_timeout: float = 600.0
    #: Use a Ray Compiled Graph for execute_model when Ray provides one. Off by default: the
    #: graph's channels busy-wait (each worker spins a core while idle, the driver while it
    #: waits for a step); see the README before turning it on.
    compiled_graph: bool = False
    #: Send small calls on a socket of the executor's own to each worker when every worker
    #: is on the driver's node (one wake-up each way instead of Ray's task path).
    direct_calls: bool = True
    #: Direct calls also to workers on other nodes than the driver's, over TCP at each such
    #: worker's node IP (authenticated as on one node). Off by default: it opens a port on
    #: every worker node; without it, workers on other nodes get Ray actor calls.
    direct_calls_across_nodes: bool = False
    #: Logical CPUs of a local instance this backend starts (default: the machine's count).
    local_num_cpus: float | None = None
    #: GPUs of a local instance this backend starts (default: Ray's detection).
    local_num_gpus: float | None = None
    #: Directory for a local instance's files (default: a fresh temp dir, removed at the end).
    temp_dir: str | None = None
    #: Forward the actors' stdout/stderr to this process (a local instance only).
    log_to_driver: bool = True

    @classmethod
    def from_backend_options(cls, options: Mapping[str, Any]) -> RayOptions:
        """Validate ``options``; an unknown key or a bad value raises :class:`ConfigError`."""
        known = {field.name for field in attrs.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(
                "backend_options",
                {key: options[key] for key in unknown},
                f"unknown key(s) for the 'ray' backend; known keys: {sorted(known)}",
            )
        values: dict[str, Any] = {}
        for key, value in options.items():
            values[key] = _VALIDATORS[key](key, value)
        return cls(**values)


def _strategy(key: str, value: object) -> str:
    if not isinstance(value, str) or value.upper() not in PLACEMENT_STRATEGIES:
        raise _error(key, value, f"{key!r} must be one of {list(PLACEMENT_STRATEGIES)}")
    return value.upper()


def _optional_number(key: str, value: object) -> float | None:
    return None if value is None else _number(key, value, minimum=0.0, strict=False)


_VALIDATORS: dict[str, Any] = {
    "address": _optional_str,
    "num_cpus_per_worker": lambda k, v: _number(k, v, minimum=0.0, strict=False),
    "resources_per_worker": _resources,
    "placement_strategy": _strategy,
    "placement_timeout": lambda k, v: _number(k, v, minimum=0.0, strict=True),
    "startup_timeout": lambda k, v: _number(k, v, minimum=0.0, strict=True),
    "compiled_graph": _bool,
    "direct_calls": _bool,
    "direct_calls_across_nodes": _bool,
    "local_num_cpus": _optional_number,
    "local_num_gpus": _optional_number,
    "temp_dir": _optional_str,
    "log_to_driver": _bool,
}
