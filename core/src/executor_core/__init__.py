"""executor-core: the contracts of the Executor SDK.

An :class:`Executor` runs one :class:`WorkerBase` per rank, in-process, in processes or on a
cluster, chosen by name from plugins found through entry points. See docs/architecture.md.

This package is the users' face (about 20 names). Backend authors use
:mod:`executor_core.backend`; the conformance kit is :mod:`executor_core.testing`.

Importing this package is cheap: names are imported from their private modules on first
use (PEP 562), so ``import executor_core`` pulls in neither attrs nor pluggy until needed, and
never torch, ray or zmq.
"""

from __future__ import annotations

import importlib

# Not ``typing.TYPE_CHECKING``: importing typing alone would add to the import time this
# package keeps small (figures: docs/benchmarks.md, Core). Type checkers treat any constant
# of this name as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from ._config import ExecutorConfig, ExecutorState, RecoveryPolicy, RecoveryRecord
    from ._errors import (
        BackendConflictError,
        BackendLoadError,
        ConfigError,
        ExecutorClosedError,
        ExecutorError,
        ExecutorFailedError,
        NodeLostError,
        RecoveringError,
        RPCTimeoutError,
        SleepStateError,
        UnknownBackendError,
        WorkerDiedError,
        WorkerError,
    )
    from ._executor import Executor, create_executor
    from ._hooks import hookimpl
    from ._version import __version__
    from ._worker import SLEEP_TAGS, WorkerBase, WorkerContext

__all__ = [
    "SLEEP_TAGS",
    "BackendConflictError",
    "BackendLoadError",
    "ConfigError",
    "Executor",
    "ExecutorClosedError",
    "ExecutorConfig",
    "ExecutorError",
    "ExecutorFailedError",
    "ExecutorState",
    "NodeLostError",
    "RPCTimeoutError",
    "RecoveringError",
    "RecoveryPolicy",
    "RecoveryRecord",
    "SleepStateError",
    "UnknownBackendError",
    "WorkerBase",
    "WorkerContext",
    "WorkerDiedError",
    "WorkerError",
    "__version__",
    "create_executor",
    "hookimpl",
]

#: Where each public name lives; a test keeps this table and __all__ equal.
_LAZY: dict[str, str] = {
    name: module
    for module, names in {
        "._config": "ExecutorConfig ExecutorState RecoveryPolicy RecoveryRecord",
        "._errors": "BackendConflictError BackendLoadError ConfigError ExecutorClosedError "
        "ExecutorError ExecutorFailedError NodeLostError RPCTimeoutError RecoveringError "
        "SleepStateError UnknownBackendError WorkerDiedError WorkerError",
        "._executor": "Executor create_executor",
        "._hooks": "hookimpl",
        "._version": "__version__",
        "._worker": "SLEEP_TAGS WorkerBase WorkerContext",
    }.items()
    for name in names.split()
}


# Hidden from type checkers (which read TYPE_CHECKING as true): with a module __getattr__
# in view, mypy would accept any name imported from this package, even one it does not have.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> Any:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module 'executor_core' has no attribute {name!r}")
        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
