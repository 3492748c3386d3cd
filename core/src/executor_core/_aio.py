"""asyncio forms of the executor's calls: sent from a thread of their own, awaited on any loop.

An ``await executor.collective_rpc_async(...)`` never blocks its event loop: the call is sent
by one thread per executor (started on the first asyncio call), in the order the awaits
began, since a send may wait (for room in a transport's queue, for another thread's send).
An await cancelled before its call was sent withdraws the call (no rank runs it); once sent,
the call runs on every rank and completes in the background, and its outcome is discarded (an
error is logged at debug level). Calls complete in submission order whatever was cancelled.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from ._errors import ExecutorClosedError

__all__ = ["AsyncSender"]

T = TypeVar("T")


def _discard(future: Future[Any]) -> None:
    """Drop the outcome of a call whose awaiter is gone (its error is logged)."""
    if not future.cancelled() and future.exception() is not None:
        logging.getLogger("executor_core").debug(
            "discarded the error of a cancelled asyncio call: %s", future.exception()
        )


def _discard_once_sent(sending: Future[Future[Any]]) -> None:
    if not sending.cancelled() and sending.exception() is None:
        sending.result().add_done_callback(_discard)


class AsyncSender:
    """Sends the calls of asyncio callers from a thread of its own, in the order they were
    made. Holds nothing of the executor between calls (a dropped executor is collected)."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def call(self, send: Callable[[], Future[T]]) -> T:
        """Run ``send()`` (which submits a non-blocking call and returns its future) on the
        sender thread, and await the call's outcome without blocking the running loop."""
        try:
            sending = self._pool.submit(send)
        except RuntimeError:  # shut down
            raise ExecutorClosedError("the executor has been shut down; create a new one") from None
        try:
            # Shielded: cancelling the await must not cancel what the wrap would cancel.
            call = await asyncio.shield(asyncio.wrap_future(sending))
        except asyncio.CancelledError:
            if not sending.cancel():  # sent, or being sent: its outcome has nobody to go to
                sending.add_done_callback(_discard_once_sent)
            raise
        try:
            return await asyncio.shield(asyncio.wrap_future(call))
        except asyncio.CancelledError:
            call.add_done_callback(_discard)
            raise

    def close(self) -> None:
        """Stop the thread once the calls already queued are sent (or refused, the executor
        being closed); later asyncio calls raise :class:`ExecutorClosedError`."""
        self._pool.shutdown(wait=True)
