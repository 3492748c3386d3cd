"""ExecutorConfig: what to run, where, and how it is split across workers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from ._errors import ConfigError

__all__ = ["FORWARDED_ENV_PREFIXES", "ExecutorConfig", "worker_environment"]

#: Prefixes of the driver's environment variables that every worker gets (unless
#: ``ExecutorConfig.env`` names the variable): the collective libraries' settings, which a
#: user sets once in the driver's shell (``NCCL_SOCKET_IFNAME``, ``NCCL_DEBUG``,
#: ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, ``GLOO_SOCKET_IFNAME``), and which workers started by a
#: cluster (Ray actors, a remote node) would not inherit.
FORWARDED_ENV_PREFIXES: tuple[str, ...] = ("NCCL_", "TORCH_NCCL_", "GLOO_")


def _positive_int(field: str) -> Any:
    def check(_inst: object, _attr: object, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(field, value, "must be an integer >= 1")

    return check


def _check_backend(_inst: object, _attr: object, value: Any) -> None:
    if isinstance(value, str):
        if not value.strip():
            raise ConfigError(
                "backend",
                value,
                "must be a registered backend name (e.g. 'uni', 'mp', 'ray'), 'auto', "
                "an Executor subclass, or a 'package.module:Class' qualname",
            )
        return
    if isinstance(value, type):
        # Imported here: _executor imports this module.
        from ._executor import Executor

        if issubclass(value, Executor):
            return
    raise ConfigError(
        "backend",
        value,
        "must be a backend name, 'auto', an Executor subclass, or a 'package.module:Class' string",
    )


def _check_worker_cls(_inst: object, _attr: object, value: Any) -> None:
    if isinstance(value, str):
        if ":" not in value:
            raise ConfigError(
                "worker_cls", value, "a string must be a qualname like 'package.module:MyWorker'"
            )
        return
    if isinstance(value, type):
        from ._worker import WorkerBase

        if issubclass(value, WorkerBase):
            return
    raise ConfigError(
        "worker_cls",
        value,
        "must be a WorkerBase subclass or a 'package.module:MyWorker' qualname",
    )


def _check_env(_inst: object, _attr: object, value: Mapping[str, str]) -> None:
    for key, val in value.items():
        if not isinstance(key, str) or not key or "=" in key:
            raise ConfigError("env", key, "keys must be non-empty strings without '='")
        if not isinstance(val, str):
            raise ConfigError("env", {key: val}, "values must be strings")


def _check_timeout(_inst: object, _attr: object, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError("rpc_timeout", value, "must be None (no timeout) or a number > 0")


def _check_nonempty_str(field: str) -> Any:
    def check(_inst: object, _attr: object, value: object) -> None:
        if not isinstance(value, str) or not value:
            raise ConfigError(field, value, "must be a non-empty string")

    return check


def _dict_copy(value: Mapping[str, Any] | None) -> dict[str, Any]:
    return dict(value) if value is not None else {}


@attrs.frozen(kw_only=True)
class ExecutorConfig:
    """Everything an executor needs to start its workers. Frozen and validated on creation.

    ``world_size`` defaults to ``tensor_parallel_size * pipeline_parallel_size``; if given,
    it must equal that product. Each invalid value raises :class:`ConfigError`, which
    names the field, the value and what is allowed.
    """

    #: The worker class each process hosts: a :class:`WorkerBase` subclass or a qualname.
    worker_cls: type | str = attrs.field(validator=_check_worker_cls)
    #: Keyword arguments for the worker's constructor (must be picklable across processes).
    worker_kwargs: dict[str, Any] = attrs.field(factory=dict, converter=_dict_copy)
    #: A registered backend name or alias, ``"auto"``, an Executor subclass, or a qualname.
    backend: str | type = attrs.field(default="auto", validator=_check_backend)
    #: Ranks per tensor-parallel group.
    tensor_parallel_size: int = attrs.field(
        default=1, validator=_positive_int("tensor_parallel_size")
    )
    #: Pipeline stages.
    pipeline_parallel_size: int = attrs.field(
        default=1, validator=_positive_int("pipeline_parallel_size")
    )
    #: Total workers; must equal tensor_parallel_size * pipeline_parallel_size.
    world_size: int = attrs.field(validator=_positive_int("world_size"))
    #: Nodes the workers span (used by ``backend="auto"`` and by multi-node backends).
    num_nodes: int = attrs.field(default=1, validator=_positive_int("num_nodes"))
    #: Environment variables set in every worker process before the worker is built. The
    #: driver's variables named by :data:`FORWARDED_ENV_PREFIXES` are added unless named here.
    env: dict[str, str] = attrs.field(factory=dict, converter=_dict_copy, validator=_check_env)
    #: Default timeout in seconds for collective calls; ``None`` waits for ever.
    rpc_timeout: float | None = attrs.field(default=None, validator=_check_timeout)
    #: Device type the workers use: ``"cpu"`` (gloo), ``"cuda"`` (nccl), or a plugin's.
    device: str = attrs.field(default="cpu", validator=_check_nonempty_str("device"))
    #: Address used for the torch.distributed rendezvous. Loopback unless told otherwise.
    distributed_host: str = attrs.field(
        default="127.0.0.1", validator=_check_nonempty_str("distributed_host")
    )
    #: Overlap scheduling with execution (raises max_concurrent_batches to 2 when pp is 1).
    async_scheduling: bool = attrs.field(
        default=False, validator=attrs.validators.instance_of(bool)
    )
    #: Backend-specific options; each backend documents and validates its own keys.
    backend_options: dict[str, Any] = attrs.field(factory=dict, converter=_dict_copy)

    @world_size.default
    def _default_world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

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
            changes["world_size"] = tp * pp
        return attrs.evolve(self, **changes)


def worker_environment(config: ExecutorConfig, driver_env: Mapping[str, str]) -> dict[str, str]:
    """What a worker's environment gets before its worker is built: the driver's variables
    with a :data:`FORWARDED_ENV_PREFIXES` prefix, then ``config.env`` (which wins)."""
    forwarded = {
        key: value for key, value in driver_env.items() if key.startswith(FORWARDED_ENV_PREFIXES)
    }
    return {**forwarded, **config.env}
