"""A single daemon thread that runs submitted calls in order and completes their futures."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["SerialRunner"]

_STOP = object()


class SerialRunner:
    """Runs callables one at a time, in submission order, on one daemon thread.

    A daemon thread (unlike ThreadPoolExecutor's) cannot keep the interpreter alive when a
    call that timed out on the caller's side never returns.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Calls submitted and not yet finished."""
        return self._pending

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        """Queue ``fn``; the returned future completes after every earlier one."""
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the runner is closed")
            self._pending += 1
        self._queue.put((fn, future))
        return future

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    result = fn()
                except BaseException as exc:  # noqa: BLE001 - delivered through the future
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            with self._lock:
                self._pending -= 1

    def close(self, timeout: float = 5.0) -> None:
        """Stop after the queued calls; wait up to ``timeout`` s for a call still running."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
