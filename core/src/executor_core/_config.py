"""What a user sets: :class:`ExecutorConfig` and its :class:`RecoveryPolicy`; and what a user
reads of recovery: :class:`ExecutorState` and :class:`RecoveryRecord`. Every field is checked
when the object is made: a bad value raises :class:`ConfigError` naming the field."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from ._errors import ConfigError

__all__ = [
    "FORWARDED_ENV_PREFIXES",
    "ExecutorConfig",
    "ExecutorState",
    "RecoveryPolicy",
    "RecoveryRecord",
    "worker_environment",
]

#: Prefixes of the driver's environment variables that every worker gets (unless
#: ``ExecutorConfig.env`` names the variable): the collective libraries' settings, which a
#: user sets once in the driver's shell and which workers started by a cluster would not
#: inherit.
FORWARDED_ENV_PREFIXES: tuple[str, ...] = ("NCCL_", "TORCH_NCCL_", "GLOO_")


def _check(allowed: str, accepts: Callable[[Any], bool], prefix: str = "") -> Any:
    """An attrs validator: a value ``accepts`` refuses raises :class:`ConfigError` naming the
    field (``prefix`` + its name), the value and ``allowed``."""

    def check(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not accepts(value):
            raise ConfigError(prefix + attribute.name, value, allowed)

    return check


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _seconds(value: object) -> bool:
    return _number(value) and value >= 0  # type: ignore[operator]  # a number, checked above


def _timeout(value: object) -> bool:
    return value is None or (_number(value) and value > 0)  # type: ignore[operator]


def _positive_int(value: object) -> bool:
    return type(value) is int and value >= 1


def _worker_cls(value: object) -> bool:
    from ._worker import WorkerBase

    if isinstance(value, str):
        return ":" in value
    return isinstance(value, type) and issubclass(value, WorkerBase)


def _str_keyed(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(key, str) for key in value)


def _env(value: object) -> bool:
    return isinstance(value, dict) and all(
        isinstance(key, str) and key and "=" not in key and isinstance(val, str)
        for key, val in value.items()
    )


def _dict_copy(value: Mapping[str, Any] | None) -> dict[str, Any]:
    """A mapping's own copy (None: an empty dict); anything else is left to the validator."""
    if value is None:
        return {}
    raw: Any = value  # what a caller passed, whatever its annotation says
    return dict(raw) if isinstance(raw, Mapping) else raw


_POSITIVE_INT = _check("must be an integer >= 1", _positive_int)
_NONEMPTY_STR = _check("must be a non-empty string", lambda v: isinstance(v, str) and bool(v))
_BOOL = _check("must be True or False", lambda v: type(v) is bool)


class ExecutorState(enum.StrEnum):
    """Where an executor stands (``Executor.state``)."""

    #: Calls go to the workers.
    RUNNING = "running"
    #: Workers died and are being started again; calls wait or fail (``wait_calls``).
    RECOVERING = "recovering"
    #: Failed for good: no recovery policy, the policy used up, a lost node, or ``fail()``.
    #: Every call raises :attr:`Executor.failure`; :meth:`Executor.recover` may bring it back.
    FAILED = "failed"
    #: Shut down.
    CLOSED = "closed"


@attrs.frozen(kw_only=True)
class RecoveryPolicy:
    """How an executor comes back when workers die (``ExecutorConfig.recovery``). Off by
    default (``recovery=None``: a death fails the executor), because only the engine knows
    whether its requests in flight can be resubmitted."""

    #: Recoveries allowed within :attr:`window_s`; one more death fails the executor.
    max_restarts: int = attrs.field(
        default=3,
        validator=_check(
            "must be an integer >= 0", lambda v: type(v) is int and v >= 0, "recovery."
        ),
    )
    #: Seconds over which :attr:`max_restarts` are counted (a rolling window).
    window_s: float = attrs.field(
        default=600.0, validator=_check("must be a number of seconds >= 0", _seconds, "recovery.")
    )
    #: Seconds before an attempt that follows a failed one, doubling with each.
    backoff_s: float = attrs.field(
        default=1.0, validator=_check("must be a number of seconds >= 0", _seconds, "recovery.")
    )
    #: True: a call made during a recovery waits for it (within the call's own timeout), then
    #: runs on the recovered workers. False: it raises :class:`~executor_core.RecoveringError`.
    wait_calls: bool = attrs.field(
        default=True,
        validator=_check("must be True or False", lambda v: type(v) is bool, "recovery."),
    )
    #: Where the backend can (``Capabilities(recovery="replace")``), start only the dead ranks
    #: again: the survivors keep their processes and memory and rejoin. False: always a group
    #: restart.
    replace_ranks: bool = attrs.field(
        default=True,
        validator=_check("must be True or False", lambda v: type(v) is bool, "recovery."),
    )
    #: Seconds the survivors of a rank replacement have to finish the calls they still held
    #: and rejoin, counted from the moment the new ranks' processes have started; past it the
    #: replacement is abandoned and every rank is restarted (:attr:`RecoveryRecord.reason`
    #: says so). A survivor busy in a longer call costs a group restart: raise it above your
    #: longest call to keep survivors then.
    rejoin_timeout_s: float = attrs.field(
        default=10.0,
        validator=_check(
            "must be a number of seconds > 0", lambda v: _number(v) and v > 0, "recovery."
        ),
    )


@attrs.frozen(kw_only=True)
class RecoveryRecord:
    """What one completed recovery did (``Executor.last_recovery``)."""

    #: The ranks whose death it answered.
    ranks: tuple[int, ...]
    #: The ranks that got new processes: the dead ones (a rank replacement) or every rank.
    restarted: tuple[int, ...]
    #: ``"replace"`` or ``"restart"``.
    kind: str
    #: Seconds from the start of the recovery until calls reached the workers again.
    duration_s: float
    #: Why every rank was restarted where the backend replaces ranks (the replacement was
    #: abandoned: a survivor did not rejoin within ``rejoin_timeout_s``, say), else "".
    reason: str = ""


@attrs.frozen(kw_only=True)
class ExecutorConfig:
    """Everything an executor needs to start its workers. Frozen and validated on creation.

    ``world_size`` defaults to ``tensor_parallel_size * pipeline_parallel_size``; if given,
    it must equal that product. Each invalid value raises :class:`ConfigError`, which
    names the field, the value and what is allowed.
    """

    #: The worker class each process hosts: a :class:`WorkerBase` subclass or a qualname.
    worker_cls: type | str = attrs.field(
        validator=_check(
            "must be a WorkerBase subclass or a 'package.module:MyWorker' qualname", _worker_cls
        )
    )
    #: Keyword arguments for the worker's constructor (must be picklable across processes).
    worker_kwargs: dict[str, Any] = attrs.field(
        factory=dict,
        converter=_dict_copy,
        validator=_check("must be a dict of keyword arguments (string keys)", _str_keyed),
    )
    #: A registered backend name or alias, ``"auto"``, an Executor subclass, or a qualname.
    backend: str | type = attrs.field(
        default="auto",
        validator=_check(
            "must be a registered backend name (e.g. 'uni', 'mp', 'ray'), 'auto', "
            "an Executor subclass, or a 'package.module:Class' qualname",
            # An Executor subclass by its interface (this module is below the executor's).
            lambda v: (
                bool(v.strip())
                if isinstance(v, str)
                else isinstance(v, type) and callable(getattr(v, "collective_rpc", None))
            ),
        ),
    )
    #: Ranks per tensor-parallel group.
    tensor_parallel_size: int = attrs.field(default=1, validator=_POSITIVE_INT)
    #: Pipeline stages.
    pipeline_parallel_size: int = attrs.field(default=1, validator=_POSITIVE_INT)
    #: Total workers; must equal tensor_parallel_size * pipeline_parallel_size.
    world_size: int = attrs.field(validator=_POSITIVE_INT)
    #: Nodes the workers span (used by ``backend="auto"`` and by multi-node backends).
    num_nodes: int = attrs.field(default=1, validator=_POSITIVE_INT)
    #: Environment variables set in every worker process before the worker is built. The
    #: driver's variables named by :data:`FORWARDED_ENV_PREFIXES` are added unless named here.
    env: dict[str, str] = attrs.field(
        factory=dict,
        converter=_dict_copy,
        validator=_check(
            "must be a dict of variable names (non-empty strings without '=') to string values",
            _env,
        ),
    )
    #: Default timeout in seconds for collective calls; ``None`` waits for ever.
    rpc_timeout: float | None = attrs.field(
        default=None,
        validator=_check("must be None (no timeout) or a finite number of seconds > 0", _timeout),
    )
    #: Device type the workers use: ``"cpu"`` (gloo), ``"cuda"`` (nccl), or a plugin's.
    device: str = attrs.field(default="cpu", validator=_NONEMPTY_STR)
    #: Address used for the torch.distributed rendezvous. Loopback unless told otherwise.
    distributed_host: str = attrs.field(default="127.0.0.1", validator=_NONEMPTY_STR)
    #: Overlap scheduling with execution (raises max_concurrent_batches to 2 when pp is 1).
    async_scheduling: bool = attrs.field(default=False, validator=_BOOL)
    #: How the executor comes back when workers die: ``None`` (the default) fails it; a
    #: :class:`~executor_core.RecoveryPolicy` starts the workers again (docs/recovery.md). A
    #: backend that cannot (``Capabilities.recovery == "none"``) refuses a policy.
    recovery: RecoveryPolicy | None = attrs.field(
        default=None,
        validator=_check(
            "must be None or an executor_core.RecoveryPolicy",
            lambda value: value is None or isinstance(value, RecoveryPolicy),
        ),
    )
    #: Seconds after which a rank that has not answered a call and does not answer a
    #: liveness probe (a frozen process, a deadlock holding the interpreter) is declared dead,
    #: killed, and recovered like any death (docs/recovery.md, "Hangs"). ``None`` never
    #: declares a hang. A backend without a probe (``Capabilities.liveness_probe`` false)
    #: refuses a bound.
    hang_timeout_s: float | None = attrs.field(
        default=None,
        validator=_check("must be None (never) or a finite number of seconds > 0", _timeout),
    )
    #: Backend-specific options: each backend documents its keys, and the executor refuses
    #: a key or a value its backend does not take (see ``executor_core.options``).
    backend_options: dict[str, Any] = attrs.field(
        factory=dict,
        converter=_dict_copy,
        validator=_check("must be a dict of option names (strings) to values", _str_keyed),
    )

    @world_size.default
    def _default_world_size(self) -> int:
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        # A bad size is refused by its own validator, which runs before world_size's.
        return tp * pp if _positive_int(tp) and _positive_int(pp) else 1

    @world_size.validator
    def _check_world_size(self, _attr: object, value: int) -> None:
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if value != tp * pp:
            raise ConfigError(
                "world_size",
                value,
                f"must equal tensor_parallel_size * pipeline_parallel_size = {tp} * {pp} = "
                f"{tp * pp}; leave it unset to derive it",
            )

    @property
    def output_rank(self) -> int:
        """The rank whose result ``execute_model`` returns: first TP rank of the last PP stage."""
        return self.world_size - self.tensor_parallel_size

    def rank_of(self, pp_rank: int, tp_rank: int) -> int:
        """The global rank of tensor-parallel rank ``tp_rank`` in pipeline stage ``pp_rank``."""
        return pp_rank * self.tensor_parallel_size + tp_rank

    def evolve(self, **changes: Any) -> ExecutorConfig:
        """A copy with ``changes`` applied (and validated). ``world_size`` is re-derived."""
        sizes = ("tensor_parallel_size", "pipeline_parallel_size")
        if "world_size" not in changes and any(name in changes for name in sizes):
            tp = changes.get(sizes[0], self.tensor_parallel_size)
            pp = changes.get(sizes[1], self.pipeline_parallel_size)
            if _positive_int(tp) and _positive_int(pp):  # else their validators refuse
                changes["world_size"] = tp * pp
        return attrs.evolve(self, **changes)


def worker_environment(config: ExecutorConfig, driver_env: Mapping[str, str]) -> dict[str, str]:
    """What a worker's environment gets before its worker is built: the driver's variables
    with a :data:`FORWARDED_ENV_PREFIXES` prefix, then ``config.env`` (which wins)."""
    forwarded = {
        key: value for key, value in driver_env.items() if key.startswith(FORWARDED_ENV_PREFIXES)
    }
    return {**forwarded, **config.env}
