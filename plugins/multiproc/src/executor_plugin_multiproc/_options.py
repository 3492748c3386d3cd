"""The ``backend_options`` the mp backend understands, validated into :class:`MultiprocOptions`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from executor_core import ConfigError

__all__ = ["MultiprocOptions"]

_MIB = 1 << 20
_START_METHODS = ("spawn", "forkserver", "fork")


def _describe_keys() -> str:
    return ", ".join(f"{f.name!r}" for f in attrs.fields(MultiprocOptions))


@attrs.frozen(kw_only=True)
class MultiprocOptions:
    """Knobs of the mp backend, read from ``ExecutorConfig.backend_options``."""

    #: How worker processes are started: "spawn" (default), "forkserver", or "fork" (only
    #: safe if the driver has no threads holding locks and no CUDA context yet).
    start_method: str = "spawn"
    #: Slots in the broadcast ring (calls that can be queued before the writer waits).
    slots: int = 4
    #: Bytes per broadcast slot; a bigger call is streamed through several slots.
    slot_bytes: int = 16 * _MIB
    #: Slots in each worker's reply ring.
    reply_slots: int = 2
    #: Bytes per reply slot (default: ``slot_bytes``).
    reply_slot_bytes: int | None = None
    #: Seconds a waiting reader or writer spins (yielding the CPU) before it sleeps. A
    #: short spin catches a reply that is microseconds away without two context switches;
    #: measured on 2 cores it halves the 1-worker no-op round trip and helps with 2 and 4
    #: workers too. A process stops spinning for a while when its yields lose the CPU to
    #: other busy processes (see ``_spin.Spinner``), see docs/benchmarks.md.
    spin_s: float = 50e-6
    #: Seconds to wait for every worker to report ready (``init_device`` + ``load_model``).
    startup_timeout: float = 600.0
    #: Seconds workers get to exit after the stop message before SIGTERM, and again before
    #: SIGKILL.
    shutdown_grace_s: float = 5.0

    @property
    def reply_bytes(self) -> int:
        """Effective bytes per reply slot."""
        return self.reply_slot_bytes if self.reply_slot_bytes is not None else self.slot_bytes

    @classmethod
    def from_backend_options(cls, options: Mapping[str, Any]) -> MultiprocOptions:
        """Validate ``options``; raise :class:`ConfigError` naming the bad key."""
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(
                "backend_options",
                dict(options),
                f"unknown key(s) {unknown} for the 'mp' backend; known keys: {_describe_keys()}",
            )
        checks = {
            "start_method": _one_of(_START_METHODS),
            "slots": _int_at_least(2),
            "slot_bytes": _int_at_least(4096),
            "reply_slots": _int_at_least(1),
            "reply_slot_bytes": _optional(_int_at_least(4096)),
            "spin_s": _number_in(0.0, 0.01),
            "startup_timeout": _number_above(0.0),
            "shutdown_grace_s": _number_at_least(0.0),
        }
        for key, value in options.items():
            problem = checks[key](value)
            if problem:
                raise ConfigError("backend_options", {key: value}, f"{key!r} {problem}")
        return cls(**options)


def _one_of(choices: tuple[str, ...]) -> Any:
    return lambda v: None if v in choices else f"must be one of {list(choices)}"


def _int_at_least(low: int) -> Any:
    def check(value: object) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            return f"must be an integer >= {low}"
        return None

    return check


def _number_at_least(low: float) -> Any:
    def check(value: object) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= low:
            return f"must be a number >= {low:g}"
        return None

    return check


def _number_in(low: float, high: float) -> Any:
    def check(value: object) -> str | None:
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not low <= value <= high
        ):
            return f"must be a number from {low:g} to {high:g} (seconds)"
        return None

    return check


def _number_above(low: float) -> Any:
    def check(value: object) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > low:
            return f"must be a number > {low:g}"
        return None

    return check


def _optional(inner: Any) -> Any:
    return lambda v: None if v is None else inner(v)
