"""Waiting for replies: blocking callers take turns reading them, a thread completes the rest.

With a polling transport (``polls = True``) the threads that wait read replies themselves,
one at a time (the leader); the others wait on the call table's condition until their call
is done or the leader leaves. Non-blocking calls are completed by one thread of the core
(the pump), which reads replies when no blocking caller does and fails calls whose deadline
has passed. With a transport that delivers replies itself, callers only wait, and the pump
watches deadlines alone.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from ._errors import RPCTimeoutError

if TYPE_CHECKING:
    from ._calls import Call, CallTable
    from ._transport import Transport

__all__ = ["Replies"]

#: Longest single wait of a reply reader or a waiting caller: between slices it looks again
#: at its deadline and at the executor's state, so that no wait depends on one wake-up alone.
_SLICE_S = 1.0
#: Longest single read of the thread that completes non-blocking calls, so that blocking
#: callers soon take over reading their own replies.
_PUMP_SLICE_S = 0.05


class Replies:
    """Brings one executor's replies to the calls that wait for them (see the module)."""

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
        table = self._table
        if table.waiters:
            with table.lock:
                table.cond.notify_all()

    def wait(self, call: Call) -> list[Any]:
        """Wait for ``call`` (a blocking caller); raise its error or RPCTimeoutError. The
        common case, one caller of a polling transport, is one lead and one poll."""
        table = self._table
        transport = self._transport
        deadline = call.deadline
        polls = transport.polls
        try:
            while not call.done:
                # Read replies here if this thread already reads them (a future's callback,
                # run by the reader, made this call) or if nobody does.
                nested = polls and self._leader == threading.get_ident()
                if nested or (polls and self._try_lead()):
                    try:
                        poll = transport.poll
                        while not call.done and table.closed_error is None:
                            if deadline is None:
                                poll(_SLICE_S)
                                continue
                            remaining = deadline - time.monotonic()
                            if remaining <= 0:
                                break
                            poll(min(remaining, _SLICE_S))
                    finally:
                        if not nested:
                            self._release_lead()
                else:
                    with table.lock:
                        if not call.done and not (polls and not self._leader):
                            table.waiters += 1
                            try:
                                table.cond.wait(_slice(deadline))
                            finally:
                                table.waiters -= 1
                if not call.done and deadline is not None and time.monotonic() >= deadline:
                    table.remove(call)
                    if not call.done:
                        raise _timed_out(call)
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
        """A non-blocking call was sent: make sure a thread completes it. A transport that
        delivers replies itself needs no thread for a call without a deadline."""
        transport = self._transport
        if not transport.polls and call.deadline is None:
            return
        if self._pump is not None:
            self._pump_wake.set()
            table = self._table
            if transport.polls and table.waiters:
                with table.lock:
                    table.cond.notify_all()
            return
        with self._lead_lock:
            if self._pump is None:
                thread = threading.Thread(
                    target=self._pump_loop, name="executor-calls", daemon=True
                )
                self._pump = thread
                thread.start()

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
        table = self._table
        transport = self._transport
        wake = self._pump_wake
        while table.closed_error is None:
            if not table.non_blocking:
                # Idle: its own event, not the table's condition, so that blocking calls do
                # not wake it (ensure_pump and wake set it).
                wake.wait(_SLICE_S)
                wake.clear()
                continue
            deadline = self._next_deadline()
            wait_s = _PUMP_SLICE_S if transport.polls else _SLICE_S
            if deadline is not None:
                wait_s = max(0.0, min(wait_s, deadline - time.monotonic()))
            if transport.polls and not table.waiters and self._try_lead():
                try:
                    # Short slices: blocking callers take over between them (they read their
                    # own replies).
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
            now = time.monotonic()
            for call in table.expired(now):
                table.remove(call)
                call.finish(False, _timed_out(call))

    def _next_deadline(self) -> float | None:
        expired = self._table.expired(float("inf"))
        deadlines = [c.deadline for c in expired if c.deadline is not None]
        return min(deadlines) if deadlines else None


def _timed_out(call: Call) -> RPCTimeoutError:
    """The error of a call past its deadline: the ranks still missing, and the failure that
    a rank already answered with (the lowest failing rank's), if any."""
    return RPCTimeoutError(call.name, call.missing(), call.timeout or 0.0, call.error)


def _slice(deadline: float | None) -> float:
    if deadline is None:
        return _SLICE_S
    return max(0.0, min(_SLICE_S, deadline - time.monotonic()))
