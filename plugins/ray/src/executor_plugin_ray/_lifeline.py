"""Lifelines: each actor exits within moments of its driver's death, whatever Ray notices.

Ray ends a job's actors once it learns that the driver is gone, which it learns from the
driver's connection to its raylet. Anything that keeps that connection open keeps the actors
alive: a child the driver forked (``multiprocessing``'s default on Linux) holds a copy of it
for as long as the child lives, so a SIGKILLed driver's actors (and their GPUs) stay taken
for that long (measured: as long as the child lived, 30 s and counting). So each actor also
holds a socket of its own to the driver, which the kernel closes the moment the driver's
process dies, on any node: the actor's thread, blocked in ``recv`` (no polling, nothing per
call), then sees end-of-file and ends the process with ``os._exit``, running nothing that
could hang (no Ray call, no atexit handler, no lock).

The driver listens while the actors connect at start (an abstract Unix socket when every
actor is on its node; else TCP at its node's IP, which Ray's own traffic
reaches), then stops listening; no port stays open and no worker node opens one. A fork of
the driver closes its copies of these sockets at once (``os.register_at_fork``), so a child
does not keep the actors alive.

Nothing is ever unpickled from these sockets. Each side proves it holds a per-executor key,
given to the actors through Ray, in a fixed-size handshake (random nonces and HMAC-SHA256
tags of them); the driver answers only a peer that passed. After it the only message is the
driver's goodbye, one byte sent when the executor shuts down, before it closes its end: that
end-of-file is then no death (the executor kills its actors through Ray anyway). Any other
end of the connection (end-of-file, a reset) ends the actor.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import socket
import threading
import time
import weakref

__all__ = ["EXIT_CODE", "HOLD_S", "ActorLifeline", "DriverLifelines", "hold"]

logger = logging.getLogger("executor_plugin_ray")

#: An address as the actors connect to it: an abstract Unix socket name, or ``(host, port)``.
Address = str | tuple[str, int]

#: Exit status of an actor whose driver is gone.
EXIT_CODE = 70
#: Seconds each side gives the handshake (connecting included); it takes milliseconds.
HOLD_S = 5.0

_NONCE = 32
_TAG = 32  # SHA-256
_ACTOR = b"executor-ray-lifeline/actor/"
_DRIVER = b"executor-ray-lifeline/driver/"
_BYE = b"\0"
_GONE_MESSAGE = b"executor_plugin_ray: the driver is gone (its lifeline closed); exiting\n"

#: The driver's sockets in this process (listeners and held ones), closed in a forked child.
_DRIVER_SOCKETS: weakref.WeakSet[socket.socket] = weakref.WeakSet()


def _close_in_child() -> None:
    """After ``fork``, in the child: close the copies of the driver's lifeline sockets, so
    that the child does not keep the actors of a dead driver alive."""
    for sock in list(_DRIVER_SOCKETS):
        with contextlib.suppress(OSError):
            sock.close()
    _DRIVER_SOCKETS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


def _tag(key: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, role + nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, size: int, deadline: float) -> bytes:
    """``size`` bytes, or ``TimeoutError`` at ``deadline`` / ``ConnectionError`` at EOF."""
    data = b""
    while len(data) < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the lifeline handshake timed out")
        sock.settimeout(remaining)
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the peer closed the lifeline during the handshake")
        data += chunk
    return data


class DriverLifelines:
    """The driver's end: listens (:meth:`listen`) while the actors connect, holds each
    authenticated connection until :meth:`close`.

    Each connection's handshake runs on a thread of its own, bounded by :data:`HOLD_S`, so a
    peer that connects and stalls holds no one up; one that fails it is dropped.
    """

    def __init__(self) -> None:
        self.key = os.urandom(32)
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._accepting: threading.Thread | None = None
        self._pending: set[socket.socket] = set()
        self._held: list[socket.socket] = []
        self._closed = False

    def listen(self, host: str | None) -> Address:
        """Start listening: on an abstract Unix socket (``host=None``: every actor is on this
        node) or on TCP at ``host``. The address for the actors."""
        if host is None:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            address: Address = f"\0executor-ray-lifeline-{os.getpid()}-{os.urandom(8).hex()}"
            listener.bind(address)
            listener.listen()
        else:
            listener = socket.create_server((host, 0))
            address = (host, listener.getsockname()[1])
        _DRIVER_SOCKETS.add(listener)
        self._listener = listener
        self._accepting = threading.Thread(
            target=self._accept, args=(listener,), name="executor-ray-lifeline", daemon=True
        )
        self._accepting.start()
        return address

    @property
    def held(self) -> int:
        """How many actors hold a lifeline."""
        with self._lock:
            return len(self._held)

    def _accept(self, listener: socket.socket) -> None:
        with listener:
            while True:
                try:
                    sock, _peer = listener.accept()
                except OSError:
                    return  # closed by stop_listening()
                with self._lock:
                    if self._closed:
                        sock.close()
                        continue
                    self._pending.add(sock)
                    _DRIVER_SOCKETS.add(sock)
                threading.Thread(
                    target=self._handshake,
                    args=(sock,),
                    name="executor-ray-lifeline-handshake",
                    daemon=True,
                ).start()

    def _handshake(self, sock: socket.socket) -> None:
        deadline = time.monotonic() + HOLD_S
        try:
            ours = os.urandom(_NONCE)
            sock.settimeout(HOLD_S)
            sock.sendall(ours)
            reply = _recv_exact(sock, _NONCE + _TAG, deadline)
            theirs, tag = reply[:_NONCE], reply[_NONCE:]
            if not hmac.compare_digest(tag, _tag(self.key, _ACTOR, ours)):
                logger.warning("refused a connection to the lifeline: bad key")
                raise ConnectionError("bad key")
            with self._lock:
                self._pending.discard(sock)
                if self._closed:
                    raise ConnectionError("closed")
                sock.settimeout(HOLD_S)
                sock.sendall(_tag(self.key, _DRIVER, theirs))
                sock.settimeout(None)
                self._held.append(sock)
        except OSError:  # ConnectionError, TimeoutError too: the peer is dropped
            with self._lock:
                self._pending.discard(sock)
            sock.close()

    def stop_listening(self) -> None:
        """Stop accepting actors (once every actor reported); drop unfinished handshakes."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes accept(); its thread closes it
        # Under the lock: a handshake that passed has left _pending (under the lock) before
        # its actor could know it passed, so no actor's lifeline is shut down here.
        with self._lock:
            for sock in self._pending:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # wakes its thread, which closes it
        thread = self._accepting
        if thread is not None and thread is not threading.current_thread():
            thread.join(HOLD_S)

    def prune(self) -> None:
        """Close the lifelines whose actor is gone (after a rank replacement: the dead
        actor's connection keeps no one alive, only a descriptor open). An actor sends
        nothing after the handshake, so a held socket with something to read (end of file, a
        reset) has lost its actor."""
        with self._lock:
            held = list(self._held)
        gone = []
        for sock in held:
            try:
                data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue  # nothing to read: its actor lives
            except OSError:
                data = b""  # reset: its actor is gone
            if not data:
                gone.append(sock)
        if not gone:
            return
        with self._lock:
            self._held = [sock for sock in self._held if sock not in gone]
        for sock in gone:
            sock.close()

    def close(self) -> None:
        """Stop listening, say goodbye on every lifeline and close it: the executor shuts
        down and kills its actors itself."""
        with self._lock:
            self._closed = True
            held, self._held = self._held, []
        self.stop_listening()
        for sock in held:
            with contextlib.suppress(OSError):  # the actor is gone already
                sock.settimeout(0)  # an empty send buffer takes the byte; never wait
                sock.send(_BYE)
            sock.close()


class ActorLifeline:
    """The actor's end: a daemon thread blocked on the socket; ``os._exit`` when it closes,
    unless the driver said goodbye first."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._thread = threading.Thread(
            target=self._watch, name="executor-ray-lifeline", daemon=True
        )
        self._thread.start()

    def _watch(self) -> None:
        sock = self._sock
        with sock:
            try:
                if sock.recv(1):  # blocks until the driver says goodbye or its end closes
                    return  # goodbye (the only message): a clean shutdown
            except OSError:
                pass  # reset: the driver's end is gone
            _exit_now()


def _exit_now() -> None:
    """End the process at once. A line on stderr says why (written by a helper thread,
    given a moment: a write to a full pipe must not keep the process alive)."""
    writer = threading.Thread(target=os.write, args=(2, _GONE_MESSAGE), daemon=True)
    with contextlib.suppress(Exception):
        writer.start()
        writer.join(0.1)
    os._exit(EXIT_CODE)


def hold(address: Address, key: bytes, timeout_s: float = HOLD_S) -> ActorLifeline:
    """In the actor: connect to the driver's lifeline at ``address``, prove and check the
    key, and watch it. ``OSError`` (``ConnectionError``, ``TimeoutError``) if the driver
    cannot be reached or does not prove the key."""
    deadline = time.monotonic() + timeout_s
    if isinstance(address, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(address)
        except BaseException:
            sock.close()
            raise
    else:
        sock = socket.create_connection(address, timeout=timeout_s)
    try:
        theirs = _recv_exact(sock, _NONCE, deadline)
        ours = os.urandom(_NONCE)
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        sock.sendall(ours + _tag(key, _ACTOR, theirs))
        tag = _recv_exact(sock, _TAG, deadline)
        if not hmac.compare_digest(tag, _tag(key, _DRIVER, ours)):
            raise ConnectionError("the lifeline's peer does not hold the key")
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return ActorLifeline(sock)
