"""The process's receive memory: the one :class:`~.buffer_cache.BufferCache` that every ring
reader and the codec share (:data:`cache`), given back by the trims the process's threads run.

Trims run on every :meth:`~BufferCache.take`, on a ring read once every :data:`IDLE_S`
(:meth:`~BufferCache.tick`), in a reader blocked on its ring while something is free to give
back (see ``Ring.wait_readable``), and in a thread that watches the cache with an
:class:`IdleTrim` (a driver's monitor of its workers: a driver receives replies only while a
caller waits, and its caller drops them whenever it likes). :func:`release` gives everything
free back at once (for a process about to sleep, or a driver whose executor is closed).
"""

from __future__ import annotations

import os

from .buffer_cache import IDLE_S, MAX_IDLE_BYTES, BufferCache

__all__ = [
    "IDLE_S",
    "MAX_IDLE_BYTES",
    "BufferCache",
    "IdleTrim",
    "cache",
]


class IdleTrim:
    """Gives the process's idle receive memory back from a loop that a thread already runs,
    without a thread or a periodic wake of its own.

    A driver receives replies only while a caller waits for them, and its caller may drop a
    large one at any moment after, so no reader of its rings is there to trim. A thread that
    sleeps anyway (a driver's monitor of its worker processes) adds :meth:`fileno` to what it
    waits on, waits at most :meth:`timeout`, and calls :meth:`run` after every wake: it then
    wakes :data:`IDLE_S` after the last large message, gives back what is free, and sleeps
    without a timeout again once the cache keeps nothing, every ``IDLE_S`` until then (while a
    received object is still referenced). Not thread-safe: one watching thread; :meth:`close`
    once it has stopped.
    """

    def __init__(self, watched: BufferCache | None = None) -> None:
        from .._shm.doorbell import Doorbell  # os and select only

        self._cache = cache if watched is None else watched
        self._bell = Doorbell()
        self._ring = self._bell.ring  # the one bound method: remove_waker finds it
        self._closed = False
        self._cache.add_waker(self._ring)

    def fileno(self) -> int:
        """The eventfd that becomes readable when the cache starts keeping memory."""
        return self._bell.fd

    def timeout(self) -> float | None:
        """Seconds to sleep at most before :meth:`run`; None: until :meth:`fileno` is
        readable."""
        return self._cache.watch_wait_s()

    def run(self) -> None:
        """After a wake (for any reason): consume the doorbell, and trim if one is due (the
        due time is worked out again: a large message may have come during the sleep)."""
        self._bell.clear()
        self._cache.trim_if_due()

    @staticmethod
    def release() -> int:
        """Give back everything free in the process's receive memory now (for a process about
        to sleep, or a driver whose executor is closed); returns the bytes unmapped."""
        return cache.release()

    @staticmethod
    def trim_if_due() -> None:
        """Give back what is free if the process has gone :data:`IDLE_S` without a large
        message, for a loop that wakes at least that often anyway (its period then bounds
        how long after going idle the process keeps it)."""
        cache.trim_if_due()

    def close(self) -> None:
        """Stop watching; close the eventfd. Idempotent (the descriptor is closed once: its
        number may be another's by a second call)."""
        if self._closed:
            return
        self._closed = True
        self._cache.remove_waker(self._ring)
        self._bell.close()


#: The process's cache, shared by every ring reader and the codec.
cache = BufferCache()
os.register_at_fork(after_in_child=lambda: cache._after_fork())  # the cache at fork time
