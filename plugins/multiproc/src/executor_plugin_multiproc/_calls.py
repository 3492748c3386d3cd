"""The driver's table of calls in flight: replies in, outcomes out, in submission order."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError
from typing import Any

from executor_core import ExecutorError

__all__ = ["CallTable", "PendingCall"]


class PendingCall:
    """One collective call: the ranks that must answer, what they said, and its outcome.

    A blocking caller polls :attr:`done`; a non-blocking call also has a :attr:`future`.
    """

    __slots__ = (
        "deadline",
        "done",
        "error",
        "expected",
        "future",
        "method",
        "ok",
        "results",
        "seq",
        "timeout",
        "value",
    )

    def __init__(
        self,
        seq: int,
        method: str,
        expected: tuple[int, ...],
        non_block: bool,
        timeout: float | None,
    ) -> None:
        self.seq = seq
        self.method = method
        self.expected = expected
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.results: dict[int, Any] = {}
        self.error: ExecutorError | None = None
        self.done = False
        self.ok = False
        self.value: Any = None
        self.future: Future[list[Any]] | None = None
        if non_block:
            self.future = Future()
            self.future.set_running_or_notify_cancel()

    @property
    def non_block(self) -> bool:
        return self.future is not None

    @property
    def complete(self) -> bool:
        return len(self.results) == len(self.expected)

    def missing(self) -> list[int]:
        """Ranks that have not answered yet."""
        return [r for r in self.expected if r not in self.results]

    def finish(self, ok: bool, value: Any) -> None:
        """Record the outcome (first one wins) and complete the future, if any."""
        if self.done:
            return
        self.ok, self.value, self.done = ok, value, True
        future = self.future
        if future is None:
            return
        try:
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)
        except InvalidStateError:
            pass

    def finish_from_replies(self) -> None:
        if self.error is not None:
            self.finish(False, self.error)
        else:
            self.finish(True, [self.results[r] for r in self.expected])

    def outcome(self) -> list[Any]:
        """The result list, or raise the call's error."""
        if not self.ok:
            raise self.value
        result: list[Any] = self.value
        return result


class CallTable:
    """Calls in flight, by sequence number.

    Replies arrive per rank in sequence order. A call completes when every expected rank
    has answered (an error from any rank, expected or not, completes it as a failure with
    the lowest failing rank's error); calls are completed strictly in submission order. A
    reply for a sequence number that is no longer in the table (its caller timed out) is
    dropped.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: OrderedDict[int, PendingCall] = OrderedDict()
        self.non_blocking = 0

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, call: PendingCall) -> None:
        with self._lock:
            self._calls[call.seq] = call
            if call.non_block:
                self.non_blocking += 1

    def on_reply(self, seq: int, rank: int, ok: bool, value: Any) -> list[PendingCall]:
        """Record a reply; return the calls now ready to finish, oldest first."""
        with self._lock:
            call = self._calls.get(seq)
            if call is None:
                return []  # late reply to a call that timed out: dropped
            if ok:
                if rank in call.expected:
                    results = call.results
                    results[rank] = value
                    if len(results) < len(call.expected):
                        return []
            elif rank in call.expected:
                # Wait for the other expected ranks, so the lowest failing rank is reported.
                if call.error is None or getattr(call.error, "rank", rank) > rank:
                    call.error = value
                call.results[rank] = None
            else:
                # A rank that only answers when it fails (unique_reply_rank): fail now.
                call.error = value
                call.results.update({r: None for r in call.expected})
            if not call.complete or next(iter(self._calls)) != seq:
                return []
            return self._pop_ready()

    def _pop_ready(self) -> list[PendingCall]:
        ready = []
        while self._calls:
            seq, call = next(iter(self._calls.items()))
            if not call.complete:
                break
            del self._calls[seq]
            if call.non_block:
                self.non_blocking -= 1
            ready.append(call)
        return ready

    def remove(self, call: PendingCall) -> list[PendingCall]:
        """Forget ``call`` (timed out or interrupted); return calls it was holding back."""
        with self._lock:
            if self._calls.pop(call.seq, None) is not None and call.non_block:
                self.non_blocking -= 1
            return self._pop_ready()

    def expired(self, now: float) -> list[PendingCall]:
        """Non-blocking calls whose deadline has passed (oldest first)."""
        with self._lock:
            return [
                c
                for c in self._calls.values()
                if c.non_block and c.deadline is not None and now >= c.deadline
            ]

    def take_all(self) -> list[PendingCall]:
        """Remove and return every call (the executor failed or is closing)."""
        with self._lock:
            calls = list(self._calls.values())
            self._calls.clear()
            self.non_blocking = 0
            return calls
