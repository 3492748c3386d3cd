"""The driver's table of calls in flight: replies in, futures out, in submission order."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError
from typing import Any

from executor_core import ExecutorError

__all__ = ["CallTable", "PendingCall"]


class PendingCall:
    """One collective call: the ranks that must answer, what they said, and its future."""

    __slots__ = (
        "deadline",
        "error",
        "expected",
        "future",
        "method",
        "non_block",
        "results",
        "seq",
        "timeout",
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
        self.non_block = non_block
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.results: dict[int, Any] = {}
        self.error: ExecutorError | None = None
        self.future: Future[list[Any]] = Future()
        self.future.set_running_or_notify_cancel()

    @property
    def complete(self) -> bool:
        return len(self.results) == len(self.expected)

    def missing(self) -> list[int]:
        """Ranks that have not answered yet."""
        return [r for r in self.expected if r not in self.results]

    def outcome(self) -> tuple[bool, Any]:
        if self.error is not None:
            return False, self.error
        return True, [self.results[r] for r in self.expected]


def resolve(future: Future[list[Any]], ok: bool, value: Any) -> None:
    """Complete ``future`` unless something else already did."""
    try:
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)
    except InvalidStateError:
        pass


class CallTable:
    """Calls in flight, by sequence number.

    Replies arrive per rank in sequence order. A call completes when every expected rank
    has answered (an error from any rank, expected or not, completes it as a failure with
    the lowest failing rank's error); futures are completed strictly in submission order.
    A reply for a sequence number that is no longer in the table (its caller timed out) is
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

    def oldest(self) -> PendingCall | None:
        with self._lock:
            for call in self._calls.values():
                return call
            return None

    def on_reply(self, seq: int, rank: int, ok: bool, value: Any) -> list[PendingCall]:
        """Record a reply; return the calls now ready to resolve, oldest first."""
        with self._lock:
            call = self._calls.get(seq)
            if call is None:
                return []  # late reply to a call that timed out: dropped
            if ok:
                if rank in call.expected:
                    call.results[rank] = value
            elif rank in call.expected:
                # Wait for the other expected ranks, so the lowest failing rank is reported.
                if call.error is None or getattr(call.error, "rank", rank) > rank:
                    call.error = value
                call.results[rank] = None
            else:
                # A rank that only answers when it fails (unique_reply_rank): fail now.
                call.error = value
                call.results.update({r: None for r in call.expected})
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
        """Calls whose deadline has passed (oldest first)."""
        with self._lock:
            return [c for c in self._calls.values() if c.deadline is not None and now >= c.deadline]

    def take_all(self) -> list[PendingCall]:
        """Remove and return every call (the executor failed or is closing)."""
        with self._lock:
            calls = list(self._calls.values())
            self._calls.clear()
            self.non_blocking = 0
            return calls

    def next_wanted_rank(self) -> int | None:
        """A rank the oldest unfinished call still waits for (the one to block on)."""
        with self._lock:
            for call in self._calls.values():
                for rank in call.expected:
                    if rank not in call.results:
                        return rank
            return None
