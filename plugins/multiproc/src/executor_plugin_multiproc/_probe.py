"""The liveness probe of a node's worker processes (``Transport.probe`` on ``mp``).

Each worker gets one end of a socket pair and a thread that answers every byte it reads with
that byte; the process that started the workers (the driver, or a node agent) keeps the
other ends. The thread is not the one running calls, so a worker busy in a long call, or
blocked in a collective that released the interpreter, answers; a stopped process (SIGSTOP),
or one frozen while it holds the interpreter's lock, does not. The thread sleeps in ``recv``
until asked: it costs nothing between probes.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections.abc import Iterable

__all__ = ["Probes", "answer_probes"]


class Probes:
    """The starting side's ends of its workers' probe sockets, by worker index."""

    def __init__(self, count: int) -> None:
        pairs = [socket.socketpair() for _ in range(count)]
        self._ours = [ours for ours, _ in pairs]
        #: The workers' ends, handed to each process at its start and closed here after.
        self.theirs = [theirs for _, theirs in pairs]
        for sock in self._ours:
            sock.setblocking(False)
        self._token = 0

    def fds(self) -> tuple[int, ...]:
        """This side's descriptors (a forked worker closes them)."""
        return tuple(sock.fileno() for sock in self._ours)

    def handed_over(self, index: int | None = None) -> None:
        """The workers (or worker ``index``) hold their ends now: close this process's
        copies."""
        for sock in self.theirs if index is None else [self.theirs[index]]:
            sock.close()

    def renew(self, index: int) -> None:
        """A new pair for worker ``index`` (its process is being replaced)."""
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        self._ours[index].close()
        self._ours[index], self.theirs[index] = ours, theirs

    def probe(self, indices: Iterable[int], timeout: float) -> set[int]:
        """The workers among ``indices`` that did not answer within ``timeout`` seconds."""
        self._token = self._token % 255 + 1  # never 0: tells this probe from earlier ones
        token = bytes([self._token])
        pending: dict[socket.socket, int] = {}
        silent: set[int] = set()
        for index in indices:
            sock = self._ours[index]
            try:
                _drain(sock)  # late answers to an earlier probe
                sock.send(token)
            except OSError:  # the worker's end is closed: the process is gone
                silent.add(index)
                continue
            pending[sock] = index
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            for sock in pending:
                selector.register(sock, selectors.EVENT_READ)
            while pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                for key, _ in selector.select(remaining):
                    sock = key.fileobj  # type: ignore[assignment]  # registered as sockets
                    try:
                        answer = _drain(sock)
                    except OSError:
                        answer = None
                    if answer is None:  # end of stream: the worker is gone
                        selector.unregister(sock)
                        silent.add(pending.pop(sock))
                    elif answer.endswith(token):
                        selector.unregister(sock)
                        del pending[sock]
        return silent | set(pending.values())

    def close(self) -> None:
        for sock in (*self._ours, *self.theirs):
            sock.close()


def _drain(sock: socket.socket) -> bytes | None:
    """Whatever is waiting on ``sock`` (non-blocking), or None at the end of the stream."""
    chunks: list[bytes] = []
    while True:
        try:
            chunk = sock.recv(256)
        except BlockingIOError:
            return b"".join(chunks)
        if not chunk:
            return None
        chunks.append(chunk)


def answer_probes(fd: int) -> threading.Thread:
    """In a worker process: answer each probe byte read from ``fd`` (a daemon thread)."""
    sock = socket.socket(fileno=fd)

    def run() -> None:
        with contextlib.suppress(OSError):
            while data := sock.recv(256):
                sock.sendall(data[-1:])

    thread = threading.Thread(target=run, name="executor-mp-probe", daemon=True)
    thread.start()
    return thread
