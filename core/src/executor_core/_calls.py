"""Calls in flight (:class:`Call`, :class:`CallTable`): the rules by which replies complete them.

The rules, written once for every backend:

- a call completes when every rank it expects has answered (all ranks, or only
  ``unique_reply_rank``); ranks that are not expected answer only when they fail;
- a failed call raises the error of the *lowest* failing rank among the expected ranks (the
  table waits for every expected rank before it decides); a failure from a rank that was not
  expected to answer completes the call at once (there is nothing else to wait for); where
  ranks ran the call without answering, a death among them wins over the failure (the
  host's ``confirm_failure``);
- calls complete strictly in submission order, so futures complete in that order too;
- a reply to a call that is no longer in flight (it timed out) is dropped;
- when the executor fails or shuts down, every call in flight fails with that error.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import TYPE_CHECKING, Any

import attrs

from ._errors import ExecutorError, WorkerError
from ._wire import RemoteFailure, dumps_method

if TYPE_CHECKING:
    from ._observe import Observation

__all__ = ["Call", "CallTable", "as_worker_error"]


@attrs.define(kw_only=True, eq=False)
class Call:
    """One collective call, as the core hands it to a transport (built with keywords only).

    Transports read :attr:`seq`, :attr:`method` (or :attr:`wire_method` across a process
    boundary), :attr:`args`, :attr:`kwargs`, :attr:`reply_rank` and :attr:`deadline`; they
    never complete a call themselves: replies go to :attr:`TransportHost.deliver`.
    """

    #: Position of the call in the one order every rank sees (1, 2, ...).
    seq: int
    #: A worker method name, or a callable ``fn(worker, *args, **kwargs)``.
    method: str | Callable[..., Any]
    #: A readable name of the method (for errors).
    name: str
    args: tuple[Any, ...] = ()
    #: Keyword arguments (``None`` when there are none).
    kwargs: dict[str, Any] | None = None
    #: The only rank whose result is wanted, or ``None`` for every rank.
    reply_rank: int | None = None
    #: The ranks that must answer.
    expected: tuple[int, ...]
    timeout: float | None = None
    future: Future[list[Any]] | None = None
    #: The core's, for an observed ``non_block`` call: told of the outcome before the future.
    _observation: Observation | None = None
    #: ``time.monotonic()`` by which the call must complete, or ``None``. A transport may
    #: move it later inside :meth:`Transport.send` for one-time set-up that must not count
    #: against the call (compiling a graph, say).
    deadline: float | None = attrs.field(init=False)
    results: dict[int, Any] = attrs.field(init=False, factory=dict)
    error: ExecutorError | None = attrs.field(init=False, default=None)
    done: bool = attrs.field(init=False, default=False)
    ok: bool = attrs.field(init=False, default=False)
    value: Any = attrs.field(init=False, default=None)
    _wire: str | bytes | None = attrs.field(init=False, default=None)

    @deadline.default
    def _deadline(self) -> float | None:
        return None if self.timeout is None else time.monotonic() + self.timeout

    @property
    def wire_method(self) -> str | bytes:
        """:attr:`method` ready for another process: a name, or cloudpickled bytes (cached)."""
        wire = self._wire
        if wire is None:
            wire = self._wire = dumps_method(self.method)
        return wire

    def missing(self) -> list[int]:
        """Expected ranks that have not answered yet."""
        return [r for r in self.expected if r not in self.results]

    def finish(self, ok: bool, value: Any) -> None:
        """Record the outcome (the first one wins) and complete the future, if any."""
        if self.done:
            return
        self.ok, self.value, self.done = ok, value, True
        if self._observation is not None:
            self._observation.end(None if ok else value)
        future = self.future
        if future is None:
            return
        try:
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)
        except InvalidStateError:  # cancelled by its holder: nothing to deliver
            pass

    def outcome(self) -> list[Any]:
        """The result list, or raise the call's error."""
        if not self.ok:
            raise self.value
        result: list[Any] = self.value
        return result


def as_worker_error(rank: int, name: str, value: Any) -> ExecutorError:
    """A failure reply as the error the caller sees: a :class:`WorkerError` (an exception the
    worker's code raised is wrapped, whatever its type, so the caller sees rank and traceback)."""
    if isinstance(value, RemoteFailure):
        return value.to_error()
    if isinstance(value, WorkerError):
        return value
    if isinstance(value, BaseException):
        return WorkerError.from_exception(rank, name, value)
    return WorkerError(rank, name, type(value).__name__, repr(value), "")


class CallTable:
    """The calls in flight, by sequence number, and the waiters for them.

    Blocking callers wait on :attr:`cond` (a condition on :attr:`lock`) while another thread
    reads replies; :attr:`waiters` counts them so that a reply wakes nobody when nobody waits.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.waiters = 0
        #: The calls in flight by sequence number, oldest first (read-only outside the table).
        self.calls: OrderedDict[int, Call] = OrderedDict()
        self.non_blocking = 0
        #: Set once: the error every call in flight and every later call fails with.
        self.closed_error: ExecutorError | None = None
        #: ``confirm(call)``, set by the host: for a call that failed while ranks it does not
        #: wait for ran it too, the death that explains the failure, or None (see
        #: ``TransportHost.confirm_failure``).
        self.confirm: Callable[[Call], ExecutorError | None] | None = None

    def add(self, call: Call) -> None:
        """Put ``call`` in flight (raise the closing error if the table is closed)."""
        with self.lock:
            if self.closed_error is not None:
                raise self.closed_error
            self.calls[call.seq] = call
            if call.future is not None:
                self.non_blocking += 1

    def deliver(self, seq: int, rank: int, ok: bool, value: Any) -> None:
        """Record one rank's reply to call ``seq``; complete whatever it makes ready."""
        with self.lock:
            call = self.calls.get(seq)
            if call is None:
                return  # a late reply to a call that timed out, or after the table closed
            if ok:
                if rank not in call.expected:
                    return
                results = call.results
                results[rank] = value
                if len(results) < len(call.expected):
                    return
            elif rank in call.expected:
                if call.error is None or getattr(call.error, "rank", rank) > rank:
                    call.error = as_worker_error(rank, call.name, value)
                call.results[rank] = None
                if len(call.results) < len(call.expected):
                    return  # wait for the others: the lowest failing rank's error wins
            else:
                # A rank that answers only when it fails: nothing else is coming from it.
                call.error = as_worker_error(rank, call.name, value)
                call.results.update(dict.fromkeys(call.expected))
            calls = self.calls
            if next(iter(calls)) != seq:
                return  # an earlier call is still open: this one completes after it
            if len(calls) == 1 and call.error is None and call.future is None:
                # The common case, one blocking call in flight and it succeeded: finish it
                # here (no future, so no callback runs under the lock).
                del calls[seq]
                call.finish(True, [call.results[r] for r in call.expected])
                if self.waiters:
                    self.cond.notify_all()
                return
            ready = self._pop_ready()
        self._finish(ready)

    def _pop_ready(self) -> list[Call]:
        ready = []
        calls = self.calls
        while calls:
            seq, call = next(iter(calls.items()))
            if len(call.results) < len(call.expected):
                break
            del calls[seq]
            if call.future is not None:
                self.non_blocking -= 1
            ready.append(call)
        return ready

    def _finish(self, ready: list[Call]) -> None:
        for call in ready:
            error = call.error
            if error is not None:
                if call.reply_rank is not None and self.confirm is not None:
                    # Other ranks ran it without answering: a survivor's error may be the
                    # news of their death, which the caller gets instead.
                    error = self.confirm(call) or error
                call.finish(False, error)
            else:
                call.finish(True, [call.results[r] for r in call.expected])
        if ready and self.waiters:
            with self.lock:
                self.cond.notify_all()

    def remove(self, call: Call) -> None:
        """Forget ``call`` (it timed out or its send failed); complete calls it held back."""
        with self.lock:
            if self.calls.pop(call.seq, None) is not None and call.future is not None:
                self.non_blocking -= 1
            ready = self._pop_ready()
        self._finish(ready)

    def expired(self, now: float) -> list[Call]:
        """Non-blocking calls whose deadline has passed, oldest first."""
        with self.lock:
            return [
                c
                for c in self.calls.values()
                if c.future is not None and c.deadline is not None and now >= c.deadline
            ]

    def close(self, error: ExecutorError) -> bool:
        """Fail every call in flight, and every later one, with ``error``; wake every waiter.

        Returns False if the table was already closed (the first error stays).
        """
        with self.lock:
            if self.closed_error is not None:
                return False
            self.closed_error = error
            calls = list(self.calls.values())
            self.calls.clear()
            self.non_blocking = 0
        for call in calls:
            call.finish(False, error)
        with self.lock:
            self.cond.notify_all()
        return True
