"""What crosses a process boundary: callables (cloudpickle) and worker failures."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import attrs

from ._errors import WorkerError, describe_exception

__all__ = ["REJOIN_METHOD", "RemoteFailure", "dumps_method", "loads_method", "method_name"]

#: The call a rank replacement sends every rank, with every rank's new context: a survivor
#: runs ``WorkerBase.rejoin`` with its own; a new rank (already in that context) only answers.
#: A dunder name, so that no worker method can be mistaken for it.
REJOIN_METHOD = "__executor_rejoin__"


def method_name(method: str | Callable[..., Any] | bytes) -> str:
    """A readable name for a worker method: its name, or a callable's qualified name."""
    if isinstance(method, str):
        return method
    if isinstance(method, bytes):
        return "<pickled callable>"
    return getattr(method, "__qualname__", None) or repr(method)


def dumps_method(method: str | Callable[..., Any]) -> str | bytes:
    """Prepare a method for another process: names pass as is, callables are cloudpickled.

    cloudpickle serialises lambdas and closures by value, which plain pickle cannot.
    """
    if isinstance(method, str):
        return method
    if not callable(method):
        raise TypeError(
            f"method must be a worker method name or a callable taking the worker, "
            f"not {type(method).__name__}"
        )
    import cloudpickle  # deferred: only needed when a callable crosses a process boundary

    data: bytes = cloudpickle.dumps(method)
    return data


def loads_method(method: str | bytes | Callable[..., Any]) -> str | Callable[..., Any]:
    """Inverse of :func:`dumps_method` (a callable passed in-process is returned unchanged)."""
    if isinstance(method, bytes):
        loaded: Callable[..., Any] = pickle.loads(method)
        return loaded
    return method


@attrs.frozen
class RemoteFailure:
    """A worker-side exception in a form that survives pickling, whatever the exception is."""

    rank: int
    method: str
    exc_type: str
    message: str
    traceback_text: str
    #: The exception pickled in the worker, or ``None`` when it could not be.
    exc_pickle: bytes | None = None

    @classmethod
    def capture(cls, rank: int, method: str, exc: BaseException) -> RemoteFailure:
        """Record ``exc`` (with its traceback) raised by ``method`` on ``rank``."""
        exc_type, text = describe_exception(exc)
        try:
            exc_pickle: bytes | None = pickle.dumps(exc, protocol=5)
        except Exception:  # noqa: BLE001 - any pickling failure just means "send text only"
            exc_pickle = None
        return cls(rank, method, exc_type, str(exc), text, exc_pickle)

    def to_error(self) -> WorkerError:
        """The driver-side :class:`WorkerError`, with the original exception chained if possible."""
        original: BaseException | None = None
        if self.exc_pickle is not None:
            try:
                original = pickle.loads(self.exc_pickle)
            except Exception:  # noqa: BLE001 - the class may not exist on the driver; text suffices
                original = None
        return WorkerError(
            self.rank, self.method, self.exc_type, self.message, self.traceback_text, original
        )
