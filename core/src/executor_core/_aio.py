"""asyncio forms of the executor's calls: sent from a thread of their own, awaited on any loop.

An ``await executor.collective_rpc_async(...)`` never blocks its event loop: the call is sent
by :class:`AsyncSender`, one thread per executor (started on the first asyncio call), since
a send may wait (for room in a transport's full queue, for another thread's send, to encode a
large argument); its reply completes a :class:`concurrent.futures.Future` on whatever thread
reads replies, which hands the outcome to the awaiting loop with
``loop.call_soon_threadsafe``. Any running loop works, and several loops in several threads
at once: each call remembers its own.

Cancellation: an await cancelled before its call was sent withdraws the call (no rank runs
it); once sent, the call runs on every rank and completes in the background, and its outcome
is discarded (an error is logged at debug level on the ``executor_core`` logger). Calls
complete in submission order whatever was cancelled, so no result reaches another awaiter.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from queue import SimpleQueue
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ._errors import ExecutorClosedError

if TYPE_CHECKING:
    import asyncio

__all__ = ["AsyncSender"]

T = TypeVar("T")

_log = logging.getLogger("executor_core")

#: How long closing waits for the sender thread to leave.
_JOIN_S = 2.0

_PENDING, _SENT, _WITHDRAWN = 0, 1, 2


class _Request(Generic[T]):
    """One asyncio call: how to send it, and the loop future its awaiter waits on."""

    __slots__ = ("loop", "send", "state", "waiter")

    def __init__(
        self,
        send: Callable[[], Future[T]],
        loop: asyncio.AbstractEventLoop,
        waiter: asyncio.Future[T],
    ) -> None:
        self.send: Callable[[], Future[T]] | None = send
        self.loop = loop
        self.waiter = waiter
        self.state = _PENDING

    def completed(self, future: Future[T]) -> None:
        """The call's future is done (on the thread that completed it): hand it to the loop."""
        try:
            self.loop.call_soon_threadsafe(_settle, self.waiter, future)
        except RuntimeError:  # the awaiting loop is closed: nobody waits any more
            _discard(future)

    def refused(self, error: BaseException) -> None:
        """The call could not be sent (the executor closed, an invalid argument)."""
        try:
            self.loop.call_soon_threadsafe(_fail, self.waiter, error)
        except RuntimeError:
            _log.debug("executor call refused after its event loop closed: %r", error)


def _settle(waiter: asyncio.Future[T], future: Future[T]) -> None:
    """On the awaiting loop: complete ``waiter`` from ``future`` (discard it if cancelled)."""
    if waiter.done():  # the awaiter was cancelled: the outcome has nobody to go to
        _discard(future)
        return
    if future.cancelled():
        waiter.cancel()
        return
    error = future.exception()
    if error is None:
        waiter.set_result(future.result())
    else:
        waiter.set_exception(error)


def _fail(waiter: asyncio.Future[Any], error: BaseException) -> None:
    if not waiter.done():
        waiter.set_exception(error)


def _discard(future: Future[Any]) -> None:
    """Drop the outcome of a call whose awaiter is gone (its error, if any, is logged)."""
    if future.cancelled():
        return
    error = future.exception()
    if error is not None:
        _log.debug("discarded the error of a cancelled asyncio call: %s", error)


class AsyncSender:
    """Sends the calls of asyncio callers from a thread of its own, in the order they were
    made, so that an event loop never waits on a send. Holds nothing of the executor between
    calls (a dropped executor is still collected)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._queue: SimpleQueue[_Request[Any] | None] = SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    async def call(self, send: Callable[[], Future[T]]) -> T:
        """Send ``send()`` (which submits a non-blocking call and returns its future) from the
        sender thread, and await the call's outcome without blocking the running loop."""
        import asyncio  # here: every executor makes a sender, only asyncio callers need asyncio

        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[T] = loop.create_future()
        request = _Request(send, loop, waiter)
        with self._lock:
            if self._closed:
                raise ExecutorClosedError("the executor has been shut down; create a new one")
            self._queue.put(request)
            if self._thread is None:
                thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread = thread
                thread.start()
        try:
            return await waiter
        except (asyncio.CancelledError, GeneratorExit):  # withdraw the call, or discard it
            with self._lock:
                if request.state == _PENDING:
                    request.state = _WITHDRAWN  # never sent: no rank runs it
                    request.send = None
            if not waiter.cancel() and not waiter.cancelled():
                # The outcome arrived just as the await was cancelled: discarded too.
                error = waiter.exception()
                if error is not None:
                    _log.debug("discarded the error of a cancelled asyncio call: %s", error)
            raise

    def _run(self) -> None:
        queue = self._queue
        while (request := queue.get()) is not None:
            self._send(request)
            # Idle with no reference to the executor (a dropped one is collected).
            del request

    def _send(self, request: _Request[Any]) -> None:
        with self._lock:
            send, request.send = request.send, None  # hold nothing of the executor once sent
            if request.state == _WITHDRAWN or send is None:
                return
            request.state = _SENT
        try:
            future = send()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiter
            request.refused(exc)
            return
        future.add_done_callback(request.completed)

    def close(self) -> None:
        """Stop the thread once the calls already queued are sent (or refused, since the
        executor is closed); later asyncio calls raise :class:`ExecutorClosedError`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        self._queue.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(_JOIN_S)
