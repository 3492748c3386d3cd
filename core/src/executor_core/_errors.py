"""The exception hierarchy: every error the SDK raises is an :class:`ExecutorError`."""

from __future__ import annotations

import traceback
from collections.abc import Sequence
from typing import Any

__all__ = [
    "BackendConflictError",
    "BackendLoadError",
    "ConfigError",
    "ExecutorClosedError",
    "ExecutorError",
    "ExecutorFailedError",
    "RPCTimeoutError",
    "RecoveringError",
    "SleepStateError",
    "UnknownBackendError",
    "WorkerDiedError",
    "WorkerError",
    "describe_exception",
]


def describe_exception(exc: BaseException) -> tuple[str, str]:
    """``(type name, formatted traceback)`` of ``exc``; builtins are named without module."""
    cls = type(exc)
    name = (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )
    return name, "".join(traceback.format_exception(exc))


#: Longest repr of a refused value that an error message quotes.
_REPR_LIMIT = 200


def _short_repr(value: object) -> str:
    """``repr(value)``, cut to :data:`_REPR_LIMIT` characters; a repr that raises is described."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - any repr may raise; the message must still be built
        return f"<{type(value).__qualname__} object (its repr raised)>"
    if len(text) > _REPR_LIMIT:
        return f"{text[:_REPR_LIMIT]}... ({len(text)} characters)"
    return text


class ExecutorError(Exception):
    """Base class of every error raised by the executor SDK."""


class ConfigError(ExecutorError, ValueError):
    """An :class:`~executor_core.ExecutorConfig` field holds a value that is not allowed."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
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
    """A worker method raised. Carries the rank and the worker-side traceback text.

    When the original exception could be pickled in the worker and unpickled here, it is
    chained as ``__cause__`` (and available as :attr:`original`).
    """

    def __init__(
        self,
        rank: int,
        method: str,
        exc_type: str,
        message: str,
        remote_traceback: str,
        original: BaseException | None = None,
    ) -> None:
        self.rank = rank
        self.method = method
        self.exc_type = exc_type
        self.message = message
        self.remote_traceback = remote_traceback
        self.original = original
        super().__init__(rank, method, exc_type, message, remote_traceback)
        if original is not None:
            self.__cause__ = original

    @classmethod
    def from_exception(cls, rank: int, method: str, exc: BaseException) -> WorkerError:
        """Wrap ``exc``, raised in-process by ``method`` on ``rank`` (no pickling involved)."""
        exc_type, text = describe_exception(exc)
        return cls(rank, method, exc_type, str(exc), text, exc)

    def __str__(self) -> str:
        return (
            f"worker rank {self.rank} raised {self.exc_type} in {self.method!r}: {self.message}\n"
            f"--- worker traceback (rank {self.rank}) ---\n{self.remote_traceback.rstrip()}"
        )

    def __reduce__(
        self,
    ) -> tuple[type[WorkerError], tuple[int, str, str, str, str, BaseException | None]]:
        return (
            type(self),
            (
                self.rank,
                self.method,
                self.exc_type,
                self.message,
                self.remote_traceback,
                self.original,
            ),
        )


class SleepStateError(ExecutorError, ValueError):
    """``sleep``/``wake_up`` was asked for something the executor's sleep state does not allow."""


class ExecutorFailedError(ExecutorError):
    """The executor has failed (a worker died, a channel broke) and cannot run calls."""


class WorkerDiedError(ExecutorFailedError):
    """A worker process or actor is gone. Names the rank and how it ended.

    When a whole node is lost (its agent or its machine), :attr:`ranks` names every rank that
    was on it and :attr:`node` the node; :attr:`rank` is the lowest of them.
    """

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
        self.rank = rank
        self.exitcode = exitcode
        self.signal = signal
        self.detail = detail
        #: Every rank lost with this failure (``(rank,)`` for a single worker).
        self.ranks: tuple[int, ...] = tuple(ranks) if ranks else (rank,)
        #: The node the ranks ran on, when the backend knows it.
        self.node = node
        how: list[str] = []
        if signal is not None:
            how.append(f"killed by signal {signal}")
        if exitcode is not None:
            how.append(f"exit code {exitcode}")
        if detail:
            how.append(detail)
        suffix = f" ({', '.join(how)})" if how else ""
        who = f"worker rank {rank}"
        if len(self.ranks) > 1:
            who = f"worker ranks {', '.join(map(str, self.ranks))}"
        where = f" on node {node}" if node else ""
        verb = "died" if len(self.ranks) == 1 else "are gone"
        super().__init__(f"{who}{where} {verb}{suffix}")

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (
            _rebuild_worker_died,
            (type(self), self.rank, self.exitcode, self.signal, self.detail, self.ranks, self.node),
        )


def _rebuild_worker_died(
    cls: type[WorkerDiedError],
    rank: int,
    exitcode: int | None,
    signal: int | None,
    detail: str,
    ranks: tuple[int, ...],
    node: str | None,
) -> WorkerDiedError:
    return cls(rank, exitcode, signal, detail, ranks=ranks, node=node)


class NodeLostError(ExecutorFailedError):
    """A node the workers need is gone, and no attempt of this executor can bring it back
    (a Ray node whose raylet died; a machine whose node agent did not join again within
    ``startup_timeout``). A backend raises it from ``Transport.start`` or
    ``Transport.replace``; the recovery then stops at once, without a cycle of attempts that
    cannot succeed, and the executor fails with it. Names the node, the ranks it held and
    what to do."""

    def __init__(
        self, node: str, ranks: Sequence[int] = (), detail: str = "", hint: str = ""
    ) -> None:
        #: The node, as the backend names it (``WorkerContext.node_id``).
        self.node = node
        #: The ranks that ran on it.
        self.ranks = tuple(ranks)
        self.detail = detail
        #: What to do about it.
        self.hint = hint
        held = f" (it held rank(s) {list(self.ranks)})" if self.ranks else ""
        text = f"node {node} is gone{held}"
        if detail:
            text += f": {detail}"
        if hint:
            text += f"; {hint}"
        super().__init__(text)

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
    """A collective call did not complete within its timeout.

    Names the method and the ranks that had not answered. Where another rank had already
    failed the call (its error is :attr:`failed`, the lowest failing rank's, also chained as
    ``__cause__``), the message says so: that failure is usually why the others still wait
    (a rank that cannot host a rendezvous leaves its peers waiting at it).
    """

    def __init__(
        self,
        method: str,
        ranks: Sequence[int],
        timeout: float,
        failed: ExecutorError | None = None,
    ) -> None:
        self.method = method
        self.ranks = tuple(ranks)
        self.timeout = timeout
        self.failed = failed
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

    def __reduce__(
        self,
    ) -> tuple[type[RPCTimeoutError], tuple[str, tuple[int, ...], float, ExecutorError | None]]:
        return (type(self), (self.method, self.ranks, self.timeout, self.failed))
