"""Calls in flight and the rules by which replies complete them, written once for every
backend (:class:`Call`, :class:`CallTable`), and how replies reach the calls that wait for
them (:class:`Replies`).

- A call completes when every rank it expects has answered (all ranks, or only
  ``unique_reply_rank``); ranks that are not expected answer only when they fail.
- A failed call raises the error of the *lowest* failing rank among the expected ranks (the
  table waits for every expected rank); a failure from a rank that was not expected
  completes the call at once. Where ranks ran the call without answering, a death among
  them wins over the failure (``TransportHost._confirm_failure``).
- Calls complete strictly in submission order, so futures complete in that order too; a
  reply to a call no longer in flight (it timed out) is dropped; when the executor fails or
  shuts down, every call in flight fails with that error.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import TYPE_CHECKING, Any

import attrs

from ._errors import ExecutorError, RemoteFailure, RPCTimeoutError, WorkerError
from ._wrapper import dumps_method

if TYPE_CHECKING:
    from ._transport import Transport

__all__ = ["Call", "CallTable", "Replies", "as_worker_error"]

#: Longest single wait of a reply reader or a waiting caller: between slices it looks again
#: at its deadline and the executor's state, so that no wait depends on one wake-up alone.
_SLICE_S = 1.0
#: Longest single read of the thread that completes non-blocking calls, so that blocking
#: callers soon take over reading their own replies.
_PUMP_SLICE_S = 0.05


@attrs.define(kw_only=True, eq=False)
class Call:
    """One collective call, as the core hands it to a transport. Transports read :attr:`seq`,
    :attr:`method` (or :attr:`wire_method` across a process boundary), :attr:`args`,
    :attr:`kwargs`, :attr:`reply_rank` and :attr:`deadline`; replies go to
    :attr:`TransportHost.deliver`, never to the call itself."""

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
    #: Told the outcome (None or the error) before the future is (an observed call's end).
    on_done: Callable[[BaseException | None], None] | None = None
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
        if self._wire is None:
            self._wire = dumps_method(self.method)
        return self._wire

    def missing(self) -> list[int]:
        """Expected ranks that have not answered yet."""
        return [r for r in self.expected if r not in self.results]

    def finish(self, ok: bool, value: Any) -> None:
        """Record the outcome (the first one wins) and complete the future, if any."""
        if self.done:
            return
        self.ok, self.value, self.done = ok, value, True
        if self.on_done is not None:
            self.on_done(None if ok else value)
        if self.future is not None:
            try:
                if ok:
                    self.future.set_result(value)
                else:
                    self.future.set_exception(value)
            except InvalidStateError:  # cancelled by its holder: nothing to deliver
                pass

    def outcome(self) -> list[Any]:
        """The result list, or raise the call's error."""
        if not self.ok:
            raise self.value
        result: list[Any] = self.value
        return result

    def timed_out(self) -> RPCTimeoutError:
        """The error of this call past its deadline: the ranks still missing, and the failure a
        rank already answered with (the lowest failing rank's), if any."""
        return RPCTimeoutError(self.name, self.missing(), self.timeout or 0.0, self.error)


def as_worker_error(rank: int, name: str, value: Any) -> ExecutorError:
    """A failure reply as the error the caller sees: a :class:`WorkerError` (whatever the
    worker's exception, the caller sees rank and traceback)."""
    if isinstance(value, RemoteFailure):
        return value.to_error()
    if isinstance(value, WorkerError):
        return value
    if isinstance(value, BaseException):
        return WorkerError.from_exception(rank, name, value)
    return WorkerError(rank, name, type(value).__name__, repr(value), "")


class CallTable:
    """The calls in flight, by sequence number, and the waiters for them. Blocking callers
    wait on :attr:`cond` while another thread reads replies; :attr:`waiters` counts them, so
    that a reply wakes nobody when nobody waits."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.waiters = 0
        #: The calls in flight by sequence number, oldest first (read-only outside the table).
        self.calls: OrderedDict[int, Call] = OrderedDict()
        self.non_blocking = 0
        #: Set once: the error every call in flight and every later call fails with.
        self.closed_error: ExecutorError | None = None
        #: ``confirm(call)``: for a failed call that ranks ran without answering, the death
        #: that explains the failure, or None (set by the host).
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
                call.results[rank] = value
            elif rank in call.expected:
                if call.error is None or getattr(call.error, "rank", rank) > rank:
                    call.error = as_worker_error(rank, call.name, value)
                call.results[rank] = None  # the others still answer: the lowest rank wins
            else:  # a rank that answers only when it fails: nothing else is coming from it
                call.error = as_worker_error(rank, call.name, value)
                call.results.update(dict.fromkeys(call.expected))
            if len(call.results) < len(call.expected) or next(iter(self.calls)) != seq:
                return  # not complete, or an earlier call is still open
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
            if error is None:
                call.finish(True, [call.results[r] for r in call.expected])
                continue
            if call.reply_rank is not None and self.confirm is not None:
                # Other ranks ran it without answering: a survivor's error may be the news
                # of their death, which the caller gets instead.
                error = self.confirm(call) or error
            call.finish(False, error)
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
        False if the table was already closed (the first error stays)."""
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


class Replies:
    """Brings one transport's replies to the calls that wait for them.

    With a polling transport (``polls = True``) the threads that wait read replies
    themselves, one at a time (the leader); the others wait on the table's condition until
    their call is done or the leader leaves. Non-blocking calls are completed by one thread
    of the core (the pump), which reads replies when no blocking caller does and fails calls
    whose deadline has passed. With a transport that delivers replies itself, callers only
    wait, and the pump watches deadlines alone.
    """

    def __init__(self, table: CallTable, transport: Transport) -> None:
        self._table = table
        self._transport = transport
        self._lead_lock = threading.Lock()
        self._leader = 0  # thread id of the thread reading replies, 0 when none
        self._pump: threading.Thread | None = None
        self._pump_wake = threading.Event()

    def _try_lead(self) -> bool:
        with self._lead_lock:
            if self._leader:
                return False
            self._leader = threading.get_ident()
            return True

    def _release_lead(self) -> None:
        self._leader = 0
        if self._table.waiters:
            with self._table.lock:
                self._table.cond.notify_all()

    def wait(self, call: Call) -> list[Any]:
        """Wait for ``call`` (a blocking caller); raise its error or RPCTimeoutError."""
        table, transport, deadline = self._table, self._transport, call.deadline
        try:
            while not call.done:
                # Read replies here if this thread already reads them (a future's callback,
                # run by the reader, made this call) or if nobody does.
                nested = transport.polls and self._leader == threading.get_ident()
                if nested or (transport.polls and self._try_lead()):
                    try:
                        while not call.done and table.closed_error is None:
                            wait_s = _slice(deadline)
                            if deadline is not None and wait_s <= 0:
                                break
                            transport.poll(wait_s)
                    finally:
                        if not nested:
                            self._release_lead()
                else:
                    with table.lock:
                        if not call.done and not (transport.polls and not self._leader):
                            table.waiters += 1
                            try:
                                table.cond.wait(_slice(deadline))
                            finally:
                                table.waiters -= 1
                if not call.done and deadline is not None and time.monotonic() >= deadline:
                    table.remove(call)
                    if not call.done:
                        raise call.timed_out()
        except BaseException:
            if not call.done:
                table.remove(call)
            raise
        return call.outcome()

    def while_blocked(self, timeout: float) -> bool:
        """:meth:`TransportHost.while_blocked`: read replies here unless another thread does."""
        transport = self._transport
        nested = self._leader == threading.get_ident()
        if not transport.polls or not (nested or self._try_lead()):
            return False
        try:
            transport.poll(timeout)
        finally:
            if not nested:
                self._release_lead()
        return True

    def ensure_pump(self, call: Call) -> None:
        """A non-blocking call was sent: make sure a thread completes it (a transport that
        delivers replies itself needs none for a call without a deadline)."""
        transport = self._transport
        if not transport.polls and call.deadline is None:
            return
        if self._pump is not None:
            self._pump_wake.set()
            if transport.polls and self._table.waiters:
                with self._table.lock:
                    self._table.cond.notify_all()
            return
        with self._lead_lock:
            if self._pump is None:
                self._pump = threading.Thread(
                    target=self._pump_loop, name="executor-calls", daemon=True
                )
                self._pump.start()

    def wake(self) -> None:
        """Wake the pump (the table closed: it ends)."""
        self._pump_wake.set()

    def leave(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the thread reading replies to leave the transport, then
        as long again for the pump to end."""
        give_up = time.monotonic() + timeout
        while self._leader and self._leader != threading.get_ident():
            if time.monotonic() >= give_up:
                break
            time.sleep(0.001)
        pump = self._pump
        if pump is not None and pump is not threading.current_thread():
            pump.join(timeout)

    def _pump_loop(self) -> None:
        # Holds the table and the transport (never the executor): closing the table ends it.
        table, transport, wake = self._table, self._transport, self._pump_wake
        while table.closed_error is None:
            if not table.non_blocking:
                # Idle: its own event, not the table's condition, so that blocking calls do
                # not wake it.
                wake.wait(_SLICE_S)
                wake.clear()
                continue
            deadlines = [c.deadline for c in table.expired(float("inf")) if c.deadline]
            wait_s = _PUMP_SLICE_S if transport.polls else _SLICE_S
            if deadlines:
                wait_s = max(0.0, min(wait_s, min(deadlines) - time.monotonic()))
            if transport.polls and not table.waiters and self._try_lead():
                try:  # short slices: blocking callers take over between them
                    transport.poll(wait_s)
                finally:
                    self._release_lead()
            elif transport.polls:
                with table.lock:  # woken when the reader leaves or a call completes
                    if table.closed_error is None:
                        table.waiters += 1
                        try:
                            table.cond.wait(wait_s)
                        finally:
                            table.waiters -= 1
            else:
                wake.wait(wait_s)  # only deadlines to watch: the transport delivers replies
                wake.clear()
            for call in table.expired(time.monotonic()):
                table.remove(call)
                call.finish(False, call.timed_out())


def _slice(deadline: float | None) -> float:
    if deadline is None:
        return _SLICE_S
    return max(0.0, min(_SLICE_S, deadline - time.monotonic()))
