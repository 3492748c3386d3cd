"""ExecutorConfig: what to run, where, and how it is split across workers."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from ._errors import ConfigError
from ._recovery_policy import RecoveryPolicy

__all__ = ["FORWARDED_ENV_PREFIXES", "ExecutorConfig", "worker_environment"]

#: Prefixes of the driver's environment variables that every worker gets (unless
#: ``ExecutorConfig.env`` names the variable): the collective libraries' settings, which a
#: user sets once in the driver's shell (``NCCL_SOCKET_IFNAME``, ``NCCL_DEBUG``,
#: ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, ``GLOO_SOCKET_IFNAME``), and which workers started by a
#: cluster (Ray actors, a remote node) would not inherit.
FORWARDED_ENV_PREFIXES: tuple[str, ...] = ("NCCL_", "TORCH_NCCL_", "GLOO_")


#: A check of one field's value: true if the value is allowed.
_Accepts = Callable[[Any], bool]


def _check(allowed: str, accepts: _Accepts) -> Callable[[Any, Any, Any], None]:
    """An attrs validator: a value ``accepts`` refuses raises :class:`ConfigError` naming the
    field, the value and ``allowed`` (which says what the field takes)."""

    def check(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not accepts(value):
            raise ConfigError(attribute.name, value, allowed)

    return check


def _is_positive_int(value: object) -> bool:
    return type(value) is int and value >= 1


def _is_backend(value: object) -> bool:
    if isinstance(value, str):
        return bool(value.strip())
    # Imported here: _executor imports this module.
    from ._executor import Executor

    return isinstance(value, type) and issubclass(value, Executor)


def _is_worker_cls(value: object) -> bool:
    if isinstance(value, str):
        return ":" in value
    from ._worker import WorkerBase

    return isinstance(value, type) and issubclass(value, WorkerBase)


def _is_str_keyed_dict(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(key, str) for key in value)


def _is_env(value: object) -> bool:
    return isinstance(value, dict) and all(
        isinstance(key, str) and key and "=" not in key and isinstance(val, str)
        for key, val in value.items()
    )


def _is_timeout(value: object) -> bool:
    if value is None:
        return True
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def _is_nonempty_str(value: object) -> bool:
    return isinstance(value, str) and bool(value)


def _dict_copy(value: Mapping[str, Any] | None) -> dict[str, Any]:
    """A mapping's own copy (None: an empty dict); anything else is left to the validator."""
    if value is None:
        return {}
    raw: Any = value  # what a caller passed, whatever its annotation says
    return dict(raw) if isinstance(raw, Mapping) else raw


_POSITIVE_INT = _check("must be an integer >= 1", _is_positive_int)
_NONEMPTY_STR = _check("must be a non-empty string", _is_nonempty_str)


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
            "must be a WorkerBase subclass or a 'package.module:MyWorker' qualname",
            _is_worker_cls,
        )
    )
    #: Keyword arguments for the worker's constructor (must be picklable across processes).
    worker_kwargs: dict[str, Any] = attrs.field(
        factory=dict,
        converter=_dict_copy,
        validator=_check("must be a dict of keyword arguments (string keys)", _is_str_keyed_dict),
    )
    #: A registered backend name or alias, ``"auto"``, an Executor subclass, or a qualname.
    backend: str | type = attrs.field(
        default="auto",
        validator=_check(
            "must be a registered backend name (e.g. 'uni', 'mp', 'ray'), 'auto', "
            "an Executor subclass, or a 'package.module:Class' qualname",
            _is_backend,
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
            _is_env,
        ),
    )
    #: Default timeout in seconds for collective calls; ``None`` waits for ever.
    rpc_timeout: float | None = attrs.field(
        default=None,
        validator=_check(
            "must be None (no timeout) or a finite number of seconds > 0", _is_timeout
        ),
    )
    #: Device type the workers use: ``"cpu"`` (gloo), ``"cuda"`` (nccl), or a plugin's.
    device: str = attrs.field(default="cpu", validator=_NONEMPTY_STR)
    #: Address used for the torch.distributed rendezvous. Loopback unless told otherwise.
    distributed_host: str = attrs.field(default="127.0.0.1", validator=_NONEMPTY_STR)
    #: Overlap scheduling with execution (raises max_concurrent_batches to 2 when pp is 1).
    async_scheduling: bool = attrs.field(
        default=False, validator=_check("must be True or False", lambda value: type(value) is bool)
    )
    #: How the executor comes back when workers die: ``None`` (the default) fails it, as a
    #: death always did; a :class:`~executor_core.RecoveryPolicy` starts the workers again
    #: (see docs/recovery.md). A backend that cannot (``Capabilities.recovery == "none"``)
    #: refuses a policy.
    recovery: RecoveryPolicy | None = attrs.field(
        default=None,
        validator=_check(
            "must be None or an executor_core.RecoveryPolicy",
            lambda value: value is None or isinstance(value, RecoveryPolicy),
        ),
    )
    #: Seconds after which a rank that has not answered a call and does not answer a
    #: liveness probe (a frozen process, a deadlock holding the interpreter) is declared dead,
    #: killed, and recovered like any death (see docs/recovery.md, "Hangs"). ``None`` (the
    #: default) never declares a hang. A backend without a probe
    #: (``Capabilities.liveness_probe`` false) refuses a bound.
    hang_timeout_s: float | None = attrs.field(
        default=None,
        validator=_check("must be None (never) or a finite number of seconds > 0", _is_timeout),
    )
    #: Backend-specific options: each backend documents its keys, and the executor refuses
    #: a key or a value its backend does not take (see ``executor_core.options``).
    backend_options: dict[str, Any] = attrs.field(
        factory=dict,
        converter=_dict_copy,
        validator=_check("must be a dict of option names (strings) to values", _is_str_keyed_dict),
    )

    @world_size.default
    def _default_world_size(self) -> int:
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        # A bad size is refused by its own validator, which runs before world_size's.
        return tp * pp if _is_positive_int(tp) and _is_positive_int(pp) else 1

    @world_size.validator
    def _check_world_size(self, _attr: object, value: int) -> None:
        product = self.tensor_parallel_size * self.pipeline_parallel_size
        if value != product:
            raise ConfigError(
                "world_size",
                value,
                f"must equal tensor_parallel_size * pipeline_parallel_size "
                f"= {self.tensor_parallel_size} * {self.pipeline_parallel_size} = {product}; "
                "leave it unset to derive it",
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
        if "world_size" not in changes and (
            "tensor_parallel_size" in changes or "pipeline_parallel_size" in changes
        ):
            tp = changes.get("tensor_parallel_size", self.tensor_parallel_size)
            pp = changes.get("pipeline_parallel_size", self.pipeline_parallel_size)
            if _is_positive_int(tp) and _is_positive_int(pp):  # else their validators refuse
                changes["world_size"] = tp * pp
        return attrs.evolve(self, **changes)


def worker_environment(config: ExecutorConfig, driver_env: Mapping[str, str]) -> dict[str, str]:
    """What a worker's environment gets before its worker is built: the driver's variables
    with a :data:`FORWARDED_ENV_PREFIXES` prefix, then ``config.env`` (which wins)."""
    forwarded = {
        key: value for key, value in driver_env.items() if key.startswith(FORWARDED_ENV_PREFIXES)
    }
    return {**forwarded, **config.env}
