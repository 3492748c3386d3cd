"""Backend resolution: the :class:`~executor_core.Executor` subclass that ``config.backend``
names."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._errors import BackendLoadError
from ._qualname import resolve_qualname

if TYPE_CHECKING:
    from ._config import ExecutorConfig
    from ._executor import Executor
    from ._registry import Registry

__all__ = ["executor_class"]


def executor_class(config: ExecutorConfig, registry: Registry | None = None) -> type[Executor]:
    """The Executor subclass for ``config.backend``.

    An Executor subclass or a ``"package.module:Class"`` string bypasses discovery; a name,
    an alias or ``"auto"`` is resolved through the plugin registry (the default one unless
    ``registry`` is given).
    """
    backend = config.backend
    if isinstance(backend, type):
        return _check_executor_class(backend, repr(backend))
    if ":" in backend:
        try:
            obj = resolve_qualname(backend)
        except ImportError as exc:
            raise BackendLoadError(f"cannot import executor class {backend!r}: {exc}") from exc
        return _check_executor_class(obj, backend)
    if registry is None:
        from ._registry import default_registry

        registry = default_registry()
    return registry.executor_class(registry.resolve_name(config))


def _check_executor_class(obj: object, origin: str) -> type[Executor]:
    from ._executor import Executor  # deferred: _executor imports this module

    if isinstance(obj, type) and issubclass(obj, Executor):
        return obj
    raise BackendLoadError(f"{origin} is not an Executor subclass (got {obj!r})")
