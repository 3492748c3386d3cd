"""The path gate: which calls are in flight, and on which of the three paths.

A call reaches the workers by one of three paths: the executor's direct sockets, Ray actor
tasks, or the compiled graph. Each path keeps its own order on every worker, but the paths
do not keep order between them (a direct call could overtake an actor task still queued on
the actor). So calls on one path may overlap, and a call on another path is sent only once
every call in flight has been answered by every rank: then every worker runs all calls in
one order, and collectives inside worker methods cannot cross.

The transport adds a :class:`Pending` entry when it sends a call and removes it once it has
read every rank's reply (a compiled-graph step whose deadline passed is dropped instead:
its output cannot be read later). Removing an entry wakes a sender waiting for its path.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

__all__ = ["ACTOR", "COMPILED", "DIRECT", "PathGate", "Pending"]

#: The paths.
DIRECT = "direct"
ACTOR = "actor"
COMPILED = "compiled"


class Pending:
    """One call in flight as the transport sees it: the replies it still has to read."""

    __slots__ = ("deadline", "left", "name", "path", "refs", "seq")

    def __init__(
        self,
        seq: int,
        path: str,
        name: str,
        left: int,
        deadline: float | None = None,
        refs: list[Any] | None = None,
    ) -> None:
        self.seq = seq
        self.path = path
        #: The method's name (for errors).
        self.name = name
        #: Ranks whose reply has not been read yet.
        self.left = left
        #: When the call's caller stops waiting (``time.monotonic()``), or None.
        self.deadline = deadline
        #: Per rank, the Ray reference to read its reply from (None once read); actor calls
        #: and compiled steps only.
        self.refs = refs


class PathGate:
    """The calls in flight, oldest first, all on one path.

    :meth:`add` is called by one sender at a time (the executor's send lock) after
    :meth:`admits` said yes; :meth:`remove` by the thread reading replies.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._entries: OrderedDict[int, Pending] = OrderedDict()
        self._waiting = 0
        #: The path of the calls in flight (meaningless while none is).
        self.path = DIRECT

    def __len__(self) -> int:
        return len(self._entries)

    def admits(self, path: str, limit: int | None = None) -> bool:
        """True if a call on ``path`` may be sent now (at most ``limit`` in flight)."""
        count = len(self._entries)
        return not count or (self.path == path and (limit is None or count < limit))

    def drained(self, path: str) -> bool:
        """True if no call on ``path`` is in flight."""
        return not self._entries or self.path != path

    # Entries are added by the sender and removed by the reader without the lock (each is
    # one dict operation); the lock is taken only to wait and to wake a waiting sender.

    def add(self, entry: Pending) -> None:
        self.path = entry.path
        self._entries[entry.seq] = entry

    def get(self, seq: int) -> Pending | None:
        return self._entries.get(seq)

    def oldest(self) -> Pending | None:
        """The entry sent first, or None."""
        while True:
            try:
                return next(iter(self._entries.values()), None)
            except RuntimeError:  # an entry came or went while it was looked up
                continue

    def remove(self, entry: Pending) -> None:
        """``entry``'s replies are all read (or will never be); wake waiting senders."""
        self._entries.pop(entry.seq, None)
        if self._waiting:
            with self._lock:
                self._cond.notify_all()

    def wait(self, ready: Callable[[], bool], timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for an entry to leave; True if ``ready()`` then."""
        with self._lock:
            # Counted before ready() is checked: a remove() after the check sees the count
            # and wakes this wait (it takes the lock, so it waits until the wait began).
            self._waiting += 1
            try:
                if ready():
                    return True
                self._cond.wait(timeout)
            finally:
                self._waiting -= 1
            return ready()

    def wake(self) -> None:
        """Wake every waiting sender (the executor failed or is closing)."""
        with self._lock:
            self._cond.notify_all()
