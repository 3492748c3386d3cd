"""The exception hierarchy (every error the SDK raises is an :class:`ExecutorError`), and
:class:`RemoteFailure`, a worker's exception as it crosses a process boundary."""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Sequence
from typing import Any

import attrs

__all__ = [
    "BackendConflictError",
    "BackendLoadError",
    "ConfigError",
    "ExecutorClosedError",
    "ExecutorError",
    "ExecutorFailedError",
    "NodeLostError",
    "RPCTimeoutError",
    "RecoveringError",
    "RemoteFailure",
    "SleepStateError",
    "UnknownBackendError",
    "WorkerDiedError",
    "WorkerError",
]


def _describe(exc: BaseException) -> tuple[str, str]:
    """``(type name, formatted traceback)`` of ``exc``; builtins are named without module."""
    cls = type(exc)
    module = "" if cls.__module__ == "builtins" else f"{cls.__module__}."
    return module + cls.__qualname__, "".join(traceback.format_exception(exc))


def _short_repr(value: object, limit: int = 200) -> str:
    """``repr(value)`` cut to ``limit`` characters; a repr that raises is described."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - any repr may raise; the message must still be built
        return f"<{type(value).__qualname__} object (its repr raised)>"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class ExecutorError(Exception):
    """Base class of every error raised by the executor SDK."""


class ConfigError(ExecutorError, ValueError):
    """An :class:`~executor_core.ExecutorConfig` field holds a value that is not allowed."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"invalid ExecutorConfig.{field}={_short_repr(value)}: {allowed}")

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, object, str]]:
        return (type(self), (self.field, self.value, self.allowed))


class UnknownBackendError(ExecutorError, LookupError):
    """No installed plugin provides the requested backend name."""


class BackendConflictError(ExecutorError, LookupError):
    """Two plugins claim the same backend name; the SDK refuses to pick one silently."""


class BackendLoadError(ExecutorError, ImportError):
    """A backend's executor class could not be imported or is not an Executor."""


class WorkerError(ExecutorError):
    """A worker method raised. Carries the rank and the worker-side traceback text; the
    original exception, where it could be pickled in the worker and unpickled here, is
    :attr:`original` and chained as ``__cause__``."""

    def __init__(
        self,
        rank: int,
        method: str,
        exc_type: str,
        message: str,
        remote_traceback: str,
        original: BaseException | None = None,
    ) -> None:
        self.rank, self.method, self.exc_type = rank, method, exc_type
        self.message, self.remote_traceback, self.original = message, remote_traceback, original
        super().__init__(rank, method, exc_type, message, remote_traceback)
        if original is not None:
            self.__cause__ = original

    @classmethod
    def from_exception(cls, rank: int, method: str, exc: BaseException) -> WorkerError:
        """Wrap ``exc``, raised in-process by ``method`` on ``rank`` (no pickling involved)."""
        exc_type, text = _describe(exc)
        return cls(rank, method, exc_type, str(exc), text, exc)

    def __str__(self) -> str:
        return (
            f"worker rank {self.rank} raised {self.exc_type} in {self.method!r}: {self.message}\n"
            f"--- worker traceback (rank {self.rank}) ---\n{self.remote_traceback.rstrip()}"
        )

    def __reduce__(self) -> tuple[type[WorkerError], tuple[Any, ...]]:
        args = (self.rank, self.method, self.exc_type, self.message, self.remote_traceback)
        return (type(self), (*args, self.original))


class SleepStateError(ExecutorError, ValueError):
    """``sleep``/``wake_up`` was asked for something the executor's sleep state does not allow."""


class ExecutorFailedError(ExecutorError):
    """The executor has failed (a worker died, a channel broke) and cannot run calls."""


class WorkerDiedError(ExecutorFailedError):
    """A worker process or actor is gone. Names the rank and how it ended. When a whole node
    is lost (its agent or its machine), :attr:`ranks` names every rank that was on it and
    :attr:`node` the node; :attr:`rank` is the lowest of them."""

    def __init__(
        self,
        rank: int,
        exitcode: int | None = None,
        signal: int | None = None,
        detail: str = "",
        *,
        ranks: tuple[int, ...] | None = None,
        node: str | None = None,
    ) -> None:
        self.rank, self.exitcode, self.signal, self.detail = rank, exitcode, signal, detail
        #: Every rank lost with this failure (``(rank,)`` for a single worker).
        self.ranks: tuple[int, ...] = tuple(ranks) if ranks else (rank,)
        #: The node the ranks ran on, when the backend knows it.
        self.node = node
        how = [f"killed by signal {signal}"] if signal is not None else []
        how += [f"exit code {exitcode}"] if exitcode is not None else []
        how += [detail] if detail else []
        suffix = f" ({', '.join(how)})" if how else ""
        many = len(self.ranks) > 1
        who = f"worker ranks {', '.join(map(str, self.ranks))}" if many else f"worker rank {rank}"
        where = f" on node {node}" if node else ""
        super().__init__(f"{who}{where} {'are gone' if many else 'died'}{suffix}")

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        fields = (self.rank, self.exitcode, self.signal, self.detail, self.ranks, self.node)
        return (_rebuild_worker_died, (type(self), *fields))


def _rebuild_worker_died(cls: type[WorkerDiedError], *fields: Any) -> WorkerDiedError:
    rank, exitcode, signal, detail, ranks, node = fields
    return cls(rank, exitcode, signal, detail, ranks=ranks, node=node)


class NodeLostError(ExecutorFailedError):
    """A node the workers need is gone, and no attempt of this executor can bring it back
    (a Ray node whose raylet died; a machine whose node agent did not join again within
    ``startup_timeout``). A backend raises it from ``Transport.start`` or
    ``Transport.replace``; the recovery then stops at once, and the executor fails with it.
    Names the node, the ranks it held and what to do."""

    def __init__(
        self, node: str, ranks: Sequence[int] = (), detail: str = "", hint: str = ""
    ) -> None:
        #: The node, as the backend names it (``WorkerContext.node_id``), and its ranks.
        self.node, self.ranks = node, tuple(ranks)
        #: What happened, and what to do about it.
        self.detail, self.hint = detail, hint
        held = f" (it held rank(s) {list(self.ranks)})" if self.ranks else ""
        text = f"node {node} is gone{held}" + (f": {detail}" if detail else "")
        super().__init__(text + (f"; {hint}" if hint else ""))

    def __reduce__(self) -> tuple[type[NodeLostError], tuple[str, tuple[int, ...], str, str]]:
        return (type(self), (self.node, self.ranks, self.detail, self.hint))


class ExecutorClosedError(ExecutorError):
    """A call was made after :meth:`Executor.shutdown`."""


class RecoveringError(ExecutorError):
    """A call was made while the executor recovers from a worker's death, and its recovery
    policy says calls fail meanwhile (``RecoveryPolicy.wait_calls=False``): retry once
    ``Executor.state`` is running again. Names the ranks that died."""

    def __init__(self, ranks: Sequence[int]) -> None:
        self.ranks = tuple(ranks)
        super().__init__(
            f"the executor is recovering from the death of worker rank(s) {list(self.ranks)}; "
            "retry once Executor.state is 'running' (or set RecoveryPolicy(wait_calls=True) "
            "to have calls wait for the recovery)"
        )

    def __reduce__(self) -> tuple[type[RecoveringError], tuple[tuple[int, ...]]]:
        return (type(self), (self.ranks,))


class RPCTimeoutError(ExecutorError, TimeoutError):
    """A collective call did not complete within its timeout. Names the method and the ranks
    that had not answered. Where another rank had already failed the call (its error is
    :attr:`failed`, the lowest failing rank's, also chained as ``__cause__``), the message
    says so: that failure is usually why the others still wait."""

    def __init__(
        self, method: str, ranks: Sequence[int], timeout: float, failed: ExecutorError | None = None
    ) -> None:
        self.method, self.ranks, self.timeout, self.failed = method, tuple(ranks), timeout, failed
        text = (
            f"collective_rpc {method!r} timed out after {timeout:g} s; "
            f"ranks that did not answer: {list(self.ranks)}"
        )
        if failed is not None:
            rank = getattr(failed, "rank", None)
            who = "another rank" if rank is None else f"rank {rank}"
            first = str(failed).split("\n", 1)[0]
            text += f"; {who} had failed the call: {first} (the whole error is chained below)"
            self.__cause__ = failed
        super().__init__(text)

    def __reduce__(self) -> tuple[type[RPCTimeoutError], tuple[Any, ...]]:
        return (type(self), (self.method, self.ranks, self.timeout, self.failed))


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
        exc_type, text = _describe(exc)
        try:
            exc_pickle: bytes | None = pickle.dumps(exc, protocol=5)
        except Exception:  # noqa: BLE001 - any pickling failure just means "send text only"
            exc_pickle = None
        return cls(rank, method, exc_type, str(exc), text, exc_pickle)

    def to_error(self) -> WorkerError:
        """The driver-side :class:`WorkerError`, with the original exception chained if it
        unpickles here."""
        original: BaseException | None = None
        if self.exc_pickle is not None:
            try:
                original = pickle.loads(self.exc_pickle)
            except Exception:  # noqa: BLE001 - the class may not exist on the driver; text suffices
                original = None
        args = (self.rank, self.method, self.exc_type, self.message, self.traceback_text)
        return WorkerError(*args, original)
