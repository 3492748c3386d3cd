"""Doorbells: eventfd wake-ups between processes.

A waiter checks its condition, then sleeps until the doorbell rings (which also consumes
the rings) or its timeout ends, then checks again. A ringer changes shared memory first and
rings after, so a wake-up is never lost (the system calls order the memory accesses), and a
stale ring only costs one extra look. Ringing costs one ``write`` system call.

A doorbell with exactly one waiter that never needs a timeout (a worker waiting for its next
call) is *blocking*: the wait is a single ``read``. Others use ``poll`` with a timeout.
"""

from __future__ import annotations

import contextlib
import os
import select

__all__ = ["Doorbell"]

_ONE = (1).to_bytes(8, "little")


class Doorbell:
    """An eventfd; pass :attr:`fd` to another process to share it."""

    def __init__(self, fd: int | None = None, *, blocking: bool = False) -> None:
        flags = os.EFD_CLOEXEC | (0 if blocking else os.EFD_NONBLOCK)
        self.fd = os.eventfd(0, flags) if fd is None else fd
        self.blocking = blocking
        self._poller = select.poll()
        self._poller.register(self.fd, select.POLLIN)

    def ring(self) -> None:
        """Wake the waiter (or make its next wait return at once)."""
        os.write(self.fd, _ONE)

    def wait(self, timeout_s: float | None) -> None:
        """Sleep until rung or ``timeout_s`` passes (None: only a blocking doorbell may wait
        without a timeout). May return early; callers re-check their condition."""
        if timeout_s is None and self.blocking:
            os.read(self.fd, 8)
            return
        ms = 1000 if timeout_s is None else max(0, int(timeout_s * 1000) + 1)
        if self._poller.poll(ms):
            try:  # noqa: SIM105 - cheaper than contextlib.suppress on this hot path
                os.read(self.fd, 8)
            except BlockingIOError:
                pass  # a blocking doorbell's other reader got it first

    def clear(self) -> None:
        """Consume a pending ring without waiting (after an outside poll saw :attr:`fd`
        readable)."""
        if self._poller.poll(0):
            with contextlib.suppress(BlockingIOError):
                os.read(self.fd, 8)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
