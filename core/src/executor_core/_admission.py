"""Admission: a config refused, before its transport is built, where the backend cannot run
it (the capabilities its spec declares, the ``backend_options`` its ``options_cls`` takes)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from ._errors import ConfigError, ExecutorError
from .options import parse_backend_options

if TYPE_CHECKING:
    from ._config import ExecutorConfig
    from ._lifecycle import Lifecycle
    from ._registry import BackendSpec, Registry

__all__ = ["admit"]


def admit(
    cls: type[Lifecycle], config: ExecutorConfig, registry: Registry, spec: BackendSpec | None
) -> tuple[str, BackendSpec | None]:
    """Check that ``cls`` can run ``config``, as its spec declares (``spec``, else the one the
    registry declares for ``cls``); return the backend's name (the class's qualified name for
    a class no plugin declares) and that spec (None for such a class)."""
    if spec is None:
        qualname = f"{cls.__module__}:{cls.__qualname__}"
        spec = next((s for s in registry.backends() if s.executor == qualname), None)
    if spec is not None:
        _check_capabilities(spec, config)
    name = spec.name if spec is not None else cls.__qualname__
    options_cls = cls.options_cls
    if not (isinstance(options_cls, type) and attrs.has(options_cls)):
        raise TypeError(
            f"{cls.__qualname__}.options_cls must be an attrs class of the backend_options it "
            f"takes, not {options_cls!r} (see executor_core.options)"
        )
    parse_backend_options(options_cls, config.backend_options, name)
    return name, spec


def _check_capabilities(spec: BackendSpec, config: ExecutorConfig) -> None:
    """Refuse a config the backend does not declare it can run (before starting anything)."""
    caps = spec.capabilities
    if config.pipeline_parallel_size > 1 and not caps.pipeline_parallel:
        raise ExecutorError(
            f"the {spec.name!r} backend does not support pipeline parallelism "
            f"(pipeline_parallel_size={config.pipeline_parallel_size}); "
            "choose a backend that does, such as 'mp' or 'ray'"
        )
    if config.num_nodes > 1 and not caps.multi_node:
        raise ExecutorError(
            f"the {spec.name!r} backend runs on one node, but num_nodes={config.num_nodes}; "
            "choose a multi-node backend such as 'ray'"
        )
    max_world_size = caps.max_world_size
    if max_world_size is not None and config.world_size > max_world_size:
        raise ExecutorError(
            f"the {spec.name!r} backend runs at most {max_world_size} worker(s), but "
            f"world_size={config.world_size}; use backend='mp' (one machine) or 'ray' (a cluster)"
        )
    if config.recovery is not None and caps.recovery == "none":
        raise ConfigError(
            "recovery",
            config.recovery,
            f"the {spec.name!r} backend cannot start its workers again in this process (its "
            "spec declares Capabilities(recovery='none')); leave recovery=None, or choose a "
            "backend that recovers, such as 'mp' or 'ray'",
        )
    if config.hang_timeout_s is not None and not caps.liveness_probe:
        raise ConfigError(
            "hang_timeout_s",
            config.hang_timeout_s,
            f"the {spec.name!r} backend cannot tell whether a rank's process still answers (its "
            "spec declares Capabilities(liveness_probe=False)); leave hang_timeout_s=None, or "
            "choose a backend with a probe, such as 'mp'",
        )
    if config.device not in caps.devices:
        raise ConfigError(
            "device",
            config.device,
            f"the {spec.name!r} backend drives {'/'.join(caps.devices)}",
        )
