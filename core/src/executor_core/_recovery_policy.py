"""What a user sets and reads of recovery: the policy (``ExecutorConfig.recovery``), the
executor's states, and the record of a completed recovery. The rules that act on them are
in ``_recovery``."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Any

import attrs

from ._errors import ConfigError

__all__ = ["ExecutorState", "RecoveryPolicy", "RecoveryRecord"]


class ExecutorState(enum.StrEnum):
    """Where an executor stands (``Executor.state``)."""

    #: Calls go to the workers.
    RUNNING = "running"
    #: Workers died and are being started again; calls wait or fail (the policy's
    #: ``wait_calls``).
    RECOVERING = "recovering"
    #: Failed for good: no recovery policy, the policy exhausted, or ``fail()``. Every call
    #: raises :attr:`Executor.failure`; :meth:`Executor.recover` may still bring it back.
    FAILED = "failed"
    #: Shut down.
    CLOSED = "closed"


def _count(value: object) -> bool:
    return type(value) is int and value >= 0


def _seconds(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def _check(allowed: str, accepts: Callable[[Any], bool]) -> Callable[[Any, Any, Any], None]:
    def check(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not accepts(value):
            raise ConfigError(f"recovery.{attribute.name}", value, allowed)

    return check


@attrs.frozen(kw_only=True)
class RecoveryPolicy:
    """How an executor comes back when workers die (``ExecutorConfig.recovery``).

    Off by default (``recovery=None``: a death fails the executor, as it always did), because
    only the engine knows whether its requests in flight can be resubmitted.
    """

    #: Recoveries allowed within :attr:`window_s`; one more death fails the executor.
    max_restarts: int = attrs.field(default=3, validator=_check("must be an integer >= 0", _count))
    #: Seconds over which :attr:`max_restarts` are counted (a rolling window).
    window_s: float = attrs.field(
        default=600.0, validator=_check("must be a number of seconds >= 0", _seconds)
    )
    #: Seconds before an attempt that follows a failed one, doubling with each (the first
    #: attempt starts at once).
    backoff_s: float = attrs.field(
        default=1.0, validator=_check("must be a number of seconds >= 0", _seconds)
    )
    #: True: a call made during a recovery waits for it (bounded by the call's own timeout)
    #: and then runs on the recovered workers. False: it fails at once with
    #: :class:`~executor_core.RecoveringError`.
    wait_calls: bool = attrs.field(
        default=True, validator=_check("must be True or False", lambda v: type(v) is bool)
    )
    #: Where the backend can (``Capabilities(recovery="replace")``), start only the dead ranks
    #: again: the survivors keep their processes and memory and rejoin. False: always a group
    #: restart.
    replace_ranks: bool = attrs.field(
        default=True, validator=_check("must be True or False", lambda v: type(v) is bool)
    )
    #: Seconds the survivors of a rank replacement have to finish the calls they still held
    #: and rejoin, counted from the moment the new ranks' processes have started (the core
    #: then sends the rejoin call); past it, the replacement is abandoned and every rank is
    #: restarted (:attr:`RecoveryRecord.reason` says so). A survivor busy in a longer call
    #: costs a group restart: raise it above your longest call to keep survivors then.
    rejoin_timeout_s: float = attrs.field(
        default=10.0,
        validator=_check("must be a number of seconds > 0", lambda v: _seconds(v) and v > 0),
    )


@attrs.frozen(kw_only=True)
class RecoveryRecord:
    """What one completed recovery did (``Executor.last_recovery``)."""

    #: The ranks whose death it answered.
    ranks: tuple[int, ...]
    #: The ranks that got new processes: the dead ones (a rank replacement) or every rank
    #: (a group restart).
    restarted: tuple[int, ...]
    #: ``"replace"`` or ``"restart"``.
    kind: str
    #: Seconds from the start of the recovery until calls reached the workers again.
    duration_s: float
    #: Why every rank was restarted where the backend replaces ranks (the replacement was
    #: abandoned: a survivor did not rejoin within ``rejoin_timeout_s``, say), else "".
    reason: str = ""
