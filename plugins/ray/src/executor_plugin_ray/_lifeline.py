"""Lifelines: each actor exits within moments of its driver's death, and takes its rings.

Ray ends a job's actors once its raylet sees the driver's connection close, which a child the
driver forked keeps open (its copy) for as long as the child lives. So each actor also holds
a socket of its own to the driver, which the kernel closes when the driver's process dies:
the actor's thread, blocked in ``recvmsg`` (nothing per call), then ends the process with
``os._exit``, running nothing that could hang. A fork of the driver closes its copies at once
(``os.register_at_fork``). The driver listens only while the actors connect (an abstract Unix
socket on its node, TCP at its node IP for the others).

Each side proves it holds a per-executor key (given to the actors through Ray): random nonces
and HMAC-SHA256 tags of them, fixed sizes; on a Unix socket the driver also checks that the
peer runs as its user. Nothing is ever unpickled. After the handshake the driver sends only
the descriptors of an actor's rings (``F`` with ``SCM_RIGHTS``: an actor is not the driver's
child and cannot inherit them) and its goodbye (one byte) at shutdown, before it closes its
end; any other end of the connection ends the actor.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
import weakref
from collections.abc import Sequence
from socket import AF_UNIX

__all__ = ["EXIT_CODE", "HOLD_S", "ActorLifeline", "Address", "DriverLifelines", "hold"]

logger = logging.getLogger("executor_plugin_ray")

#: An address as the actors connect to it: an abstract Unix socket name, or ``(host, port)``.
Address = str | tuple[str, int]

#: Exit status of an actor whose driver is gone.
EXIT_CODE = 70
#: Seconds each side gives the handshake (connecting included); it takes milliseconds.
HOLD_S = 5.0

_NONCE = _TAG = 32
_ACTOR, _DRIVER = b"executor-ray-lifeline/actor/", b"executor-ray-lifeline/driver/"
_BYE, _FDS = b"\0", b"F"
_GONE = b"executor_plugin_ray: the driver is gone (its lifeline closed); exiting\n"
_CRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid

#: The driver's sockets in this process (listeners and held ones), closed in a forked child.
_DRIVER_SOCKETS: weakref.WeakSet[socket.socket] = weakref.WeakSet()


def _close_in_child() -> None:
    for sock in list(_DRIVER_SOCKETS):
        with contextlib.suppress(OSError):
            sock.close()
    _DRIVER_SOCKETS.clear()


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
    authenticated connection until :meth:`close`. Each handshake runs on a thread of its own,
    bounded by :data:`HOLD_S`, so a peer that stalls holds no one up."""

    def __init__(self) -> None:
        self.key = os.urandom(32)
        self._lock = threading.Lock()
        #: Each listener and its accepting thread.
        self._listening: dict[socket.socket, threading.Thread] = {}
        self._pending: set[socket.socket] = set()
        #: Each held connection, with its peer's pid on a Unix socket (None on TCP).
        self._held: dict[socket.socket, int | None] = {}
        self._closed = False

    def listen(self, host: str | None) -> Address:
        """Listen (again) for actors: on an abstract Unix socket (``host=None``: the actors on
        this node, which can take descriptors) or on TCP at ``host``. Their address."""
        if host is None:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            address: Address = f"\0executor-ray-lifeline-{os.getpid()}-{os.urandom(8).hex()}"
            listener.bind(address)
            listener.listen()
        else:
            listener = socket.create_server((host, 0))
            address = (host, listener.getsockname()[1])
        _DRIVER_SOCKETS.add(listener)
        thread = threading.Thread(
            target=self._accept, args=(listener,), name="executor-ray-lifeline", daemon=True
        )
        self._listening[listener] = thread
        thread.start()
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
            pid = None
            if sock.family == socket.AF_UNIX:
                pid, uid, _gid = _CRED.unpack(
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
                )
                if uid != os.getuid():
                    raise ConnectionError(f"a peer of another user (uid {uid})")
            ours = os.urandom(_NONCE)
            sock.settimeout(HOLD_S)
            sock.sendall(ours)
            reply = _recv_exact(sock, _NONCE + _TAG, deadline)
            if not hmac.compare_digest(reply[_NONCE:], _tag(self.key, _ACTOR, ours)):
                raise ConnectionError("bad key")
            with self._lock:
                self._pending.discard(sock)
                if self._closed:
                    raise ConnectionError("closed")
                sock.sendall(_tag(self.key, _DRIVER, reply[:_NONCE]))
                sock.settimeout(None)
                self._held[sock] = pid
        except OSError as exc:  # ConnectionError, TimeoutError too: the peer is dropped
            logger.debug("refused a connection to the lifeline: %s", exc)
            with self._lock:
                self._pending.discard(sock)
            sock.close()

    def send_fds(self, pid: int, fds: Sequence[int]) -> None:
        """Hand ``fds`` to the actor of process ``pid`` (on this node) over its lifeline.
        ``LookupError`` if it holds none."""
        with self._lock:
            held = [sock for sock, peer in self._held.items() if peer == pid]
        if not held:
            raise LookupError(f"the Ray actor of pid {pid} holds no lifeline on this node")
        message = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        held[-1].sendmsg([_FDS], message, socket.MSG_DONTWAIT)  # an idle socket: never waits

    def stop_listening(self, keep_unix: bool = False) -> None:
        """Stop accepting actors (on TCP only with ``keep_unix``); drop unfinished
        handshakes."""
        kept = {s: t for s, t in self._listening.items() if keep_unix and s.family == AF_UNIX}
        stopped = {s: t for s, t in self._listening.items() if s not in kept}
        self._listening = kept
        for listener in stopped:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes accept(); its thread closes it
        with self._lock:  # a handshake that passed has left _pending (under the lock)
            for sock in self._pending:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # wakes its thread, which closes it
        for thread in stopped.values():
            if thread is not threading.current_thread():
                thread.join(HOLD_S)

    def prune(self) -> None:
        """Close the lifelines whose actor is gone (after a rank replacement). An actor sends
        nothing after the handshake: something to read (end of file, a reset) means gone."""
        gone = []
        with self._lock:
            for sock in self._held:
                try:
                    if not sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                        gone.append(sock)
                except BlockingIOError:
                    continue  # nothing to read: its actor lives
                except OSError:
                    gone.append(sock)  # reset: its actor is gone
            for sock in gone:
                del self._held[sock]
        for sock in gone:
            sock.close()

    def close(self) -> None:
        """Stop listening, say goodbye on every lifeline and close it (a cleanup)."""
        with self._lock:
            self._closed = True
            held, self._held = list(self._held), {}
        self.stop_listening()
        for sock in held:
            with contextlib.suppress(OSError):  # the actor is gone already
                sock.settimeout(0)  # an empty send buffer takes the byte; never wait
                sock.send(_BYE)
            sock.close()


class ActorLifeline:
    """The actor's end: a daemon thread blocked on the socket; ``os._exit`` when it closes,
    unless the driver said goodbye first. It keeps the descriptors the driver sends."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._fds: list[int] = []
        self._got_fds = threading.Condition()
        threading.Thread(target=self._watch, name="executor-ray-lifeline", daemon=True).start()

    def take_fds(self, timeout: float) -> list[int]:
        """The descriptors the driver sent last (waits up to ``timeout`` s for them)."""
        with self._got_fds:
            if not self._got_fds.wait_for(lambda: self._fds, timeout):
                raise TimeoutError(f"the driver sent no descriptors within {timeout:g} s")
            fds, self._fds = self._fds, []
        return fds

    def _watch(self) -> None:
        sock = self._sock
        space = socket.CMSG_SPACE(16 * array.array("i").itemsize)
        with sock:
            try:
                while True:  # until the driver says goodbye or its end closes
                    data, ancillary, _flags, _ = sock.recvmsg(1, space)
                    if data == _BYE:
                        return  # a clean shutdown
                    if data != _FDS:
                        break
                    fds = array.array("i")
                    for level, kind, payload in ancillary:
                        if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS):
                            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                    with self._got_fds:
                        self._fds = list(fds)
                        self._got_fds.notify_all()
            except OSError:
                pass  # reset: the driver's end is gone
            _exit_now()


def _exit_now() -> None:
    """End the process at once; a line on stderr says why (from a helper thread, given a
    moment: a write to a full pipe must not keep the process alive)."""
    writer = threading.Thread(target=os.write, args=(2, _GONE), daemon=True)
    with contextlib.suppress(Exception):
        writer.start()
        writer.join(0.1)
    os._exit(EXIT_CODE)


def hold(address: Address, key: bytes, timeout_s: float = HOLD_S) -> ActorLifeline:
    """In the actor: connect to the driver's lifeline at ``address``, prove and check the
    key, and watch it. ``OSError`` if the driver cannot be reached or does not prove it."""
    deadline = time.monotonic() + timeout_s
    if isinstance(address, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET)
    try:
        sock.settimeout(timeout_s)
        sock.connect(address)
        theirs = _recv_exact(sock, _NONCE, deadline)
        ours = os.urandom(_NONCE)
        sock.sendall(ours + _tag(key, _ACTOR, theirs))
        if not hmac.compare_digest(_recv_exact(sock, _TAG, deadline), _tag(key, _DRIVER, ours)):
            raise ConnectionError("the lifeline's peer does not hold the key")
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return ActorLifeline(sock)
