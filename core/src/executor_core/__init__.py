"""executor-core: the contracts of the Executor SDK.

An :class:`Executor` runs one :class:`WorkerBase` per rank, in-process, in processes or on a
cluster, chosen by name from plugins found through entry points. See docs/architecture.md.

Importing this package is cheap: names are imported from their private modules on first
use (PEP 562), so ``import executor_core`` pulls in neither attrs nor pluggy until needed, and
never torch, ray or zmq.
"""

from __future__ import annotations

import importlib

# Not ``typing.TYPE_CHECKING``: importing typing alone costs several ms here. Type checkers
# treat any constant of this name as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from ._config import ExecutorConfig
    from ._errors import (
        BackendConflictError,
        BackendLoadError,
        ConfigError,
        ExecutorClosedError,
        ExecutorError,
        ExecutorFailedError,
        RPCTimeoutError,
        SleepStateError,
        UnknownBackendError,
        WorkerDiedError,
        WorkerError,
    )
    from ._executor import Executor, FailureCallback, chain_future, create_executor
    from ._hookspecs import PROJECT_NAME, hookimpl
    from ._net import find_free_port, tcp_init_method
    from ._qualname import qualname_of, resolve_qualname
    from ._registry import (
        ENTRY_POINT_GROUP,
        IN_TREE_BACKENDS,
        PLUGINS_ENV_VAR,
        BackendSpec,
        BrokenPlugin,
        Capabilities,
        Registry,
        default_registry,
    )
    from ._version import __version__
    from ._wire import RemoteFailure, dumps_method, loads_method, method_name
    from ._worker import SLEEP_TAGS, WorkerBase, WorkerContext
    from ._wrapper import WorkerWrapper

__all__ = [
    "ENTRY_POINT_GROUP",
    "IN_TREE_BACKENDS",
    "PLUGINS_ENV_VAR",
    "PROJECT_NAME",
    "SLEEP_TAGS",
    "BackendConflictError",
    "BackendLoadError",
    "BackendSpec",
    "BrokenPlugin",
    "Capabilities",
    "ConfigError",
    "Executor",
    "ExecutorClosedError",
    "ExecutorConfig",
    "ExecutorError",
    "ExecutorFailedError",
    "FailureCallback",
    "RPCTimeoutError",
    "Registry",
    "RemoteFailure",
    "SleepStateError",
    "UnknownBackendError",
    "WorkerBase",
    "WorkerContext",
    "WorkerDiedError",
    "WorkerError",
    "WorkerWrapper",
    "__version__",
    "chain_future",
    "create_executor",
    "default_registry",
    "dumps_method",
    "find_free_port",
    "hookimpl",
    "loads_method",
    "method_name",
    "qualname_of",
    "resolve_qualname",
    "tcp_init_method",
]

_LAZY: dict[str, str] = {
    "BackendConflictError": "._errors",
    "BackendLoadError": "._errors",
    "BackendSpec": "._registry",
    "BrokenPlugin": "._registry",
    "Capabilities": "._registry",
    "ConfigError": "._errors",
    "ENTRY_POINT_GROUP": "._registry",
    "Executor": "._executor",
    "ExecutorClosedError": "._errors",
    "ExecutorConfig": "._config",
    "ExecutorError": "._errors",
    "ExecutorFailedError": "._errors",
    "FailureCallback": "._executor",
    "IN_TREE_BACKENDS": "._registry",
    "PLUGINS_ENV_VAR": "._registry",
    "PROJECT_NAME": "._hookspecs",
    "RPCTimeoutError": "._errors",
    "Registry": "._registry",
    "RemoteFailure": "._wire",
    "SLEEP_TAGS": "._worker",
    "SleepStateError": "._errors",
    "UnknownBackendError": "._errors",
    "WorkerBase": "._worker",
    "WorkerContext": "._worker",
    "WorkerDiedError": "._errors",
    "WorkerError": "._errors",
    "WorkerWrapper": "._wrapper",
    "__version__": "._version",
    "chain_future": "._executor",
    "create_executor": "._executor",
    "default_registry": "._registry",
    "dumps_method": "._wire",
    "find_free_port": "._net",
    "hookimpl": "._hookspecs",
    "loads_method": "._wire",
    "method_name": "._wire",
    "qualname_of": "._qualname",
    "resolve_qualname": "._qualname",
    "tcp_init_method": "._net",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'executor_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
