"""The gate of a :class:`~.link.Listener`: zmq takes no message from a peer until it proved
it holds the secret.

zmq reads a whole multipart message, every part of it, before the link can check a byte; the
frame's MAC is therefore checked too late to bound what a peer *without* the secret makes a
listener hold (the parts of a message it never finishes stay buffered). The gate works one
level down, in zmq's own handshake: the listener speaks ZMTP's PLAIN mechanism and answers
zmq's authentication requests (ZAP, RFC 27) itself. A dialer presents a token, a random nonce
and its HMAC-SHA256 under the secret (:func:`dialer_token`); zmq accepts messages on that
connection only once the token verifies. Until then a connection can make zmq hold one zmq
part (at most ``Limits.chunk_bytes``, zmq's ``MAXMSGSIZE``) for at most
``Limits.handshake_s`` (zmq's ``HANDSHAKE_IVL``), and the gate cuts connections beyond
``Limits.max_pending`` that are still in the handshake.

The token proves the secret without revealing it, but it is sent in the clear and a dialer
keeps it for its reconnections: someone who can observe the network can present a token it
saw, pass the gate, and then meet the frame checks of :mod:`.link` like anyone else (it can
also drop or delay traffic; see docs/security.md).

Connections are counted from zmq's monitor events. zmq names a connection (its descriptor)
when it accepts it and when it drops it, but neither zmq nor ZAP says which descriptor a
handshake belongs to, so the gate counts as pending the connections accepted within the last
``handshake_s`` less those it admitted in that time (zmq drops any connection whose
handshake outlasts it). Beyond ``max_pending`` the newest are cut, as a full accept queue
would refuse them: sessions already open are never touched, and a dialer cut during its
handshake loses nothing (zmq dials again and sends what it queued once admitted). A
connection is cut by shutting its TCP socket down through a duplicate of zmq's descriptor,
after checking that it is a connection to this listener's port; zmq then sees it close and
frees what it held.

Everything here runs on the listener's owner thread, inside its ``recv`` and ``wait``.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import os
import secrets
import socket
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from .frames import NONCE_BYTES, DropReason, Limits

__all__ = ["Gate", "dialer_token"]

# zmq asks the handler bound here, in the socket's context, to authenticate each connection.
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_ZAP_DOMAIN = b"executor-channel"
_LABEL = b"executor-channel/1 gate\x00"
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
# What the drop counter calls a connection refused or cut at the gate (zmq does not say who).
_GATE_PEER = "a connection in zmq's handshake"


def _token_mac(key: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, _LABEL + nonce, hashlib.sha256).digest()


def dialer_token(key: bytes) -> tuple[bytes, bytes]:
    """A fresh ``(username, password)`` for zmq's PLAIN mechanism: a random nonce and its
    HMAC under ``key``, hex encoded."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    return nonce.hex().encode(), _token_mac(key, nonce).hex().encode()


def _valid(key: bytes, username: bytes, password: bytes) -> bool:
    try:
        nonce = bytes.fromhex(username.decode("ascii"))
        mac = bytes.fromhex(password.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return False
    return len(nonce) == NONCE_BYTES and hmac.compare_digest(_token_mac(key, nonce), mac)


class Gate:
    """zmq-level admission for one listening ``socket`` (set up before it binds).

    ``count_drop(peer, reason)`` records a refused or cut connection. :attr:`sockets` are
    what the owner polls besides the link's socket; :meth:`service` handles them.
    """

    def __init__(
        self,
        key: bytes,
        context: zmq.Context[Any],
        sock: zmq.Socket[Any],
        limits: Limits,
        count_drop: Callable[[str, DropReason], None],
    ) -> None:
        self._key = key
        self._sock = sock
        self._limits = limits
        self._count_drop = count_drop
        self._port = 0
        # Accept time of each open connection, by zmq's descriptor, oldest first.
        self._open: dict[int, float] = {}
        # When the gate admitted each connection of the last handshake_s (zmq does not say which
        # descriptor it was).
        self._admitted: collections.deque[float] = collections.deque()
        self._zap: zmq.Socket[Any] = context.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        try:
            self._zap.bind(_ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            self._zap.close()
            raise RuntimeError(
                "this zmq context already serves another listener's gate: give each "
                "Listener its own context (the default)"
            ) from exc
        try:
            sock.setsockopt(zmq.PLAIN_SERVER, 1)
            sock.setsockopt(zmq.ZAP_DOMAIN, _ZAP_DOMAIN)
            sock.setsockopt(zmq.HANDSHAKE_IVL, max(1, round(limits.handshake_s * 1000)))
            self._monitor: zmq.Socket[Any] = sock.get_monitor_socket(_EVENTS)
        except BaseException:
            self._zap.close()
            raise
        self.sockets: tuple[zmq.Socket[Any], ...] = (self._zap, self._monitor)

    def bound(self, port: int) -> None:
        """Tell the gate the TCP port its socket listens on (connections are checked by it)."""
        self._port = port

    def service(self) -> None:
        """Answer waiting authentication requests, read connection events, cut the excess."""
        while True:
            try:
                request = self._zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._answer(request)
        accepted = False
        while True:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_ACCEPTED:
                self._open[value] = time.monotonic()
                accepted = True
            elif kind in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                self._open.pop(value, None)
        if accepted:
            self._cut_excess()

    def _answer(self, request: list[bytes]) -> None:
        # RFC 27: version, request id, domain, address, identity, mechanism, credentials...
        if len(request) < 6 or request[0] != b"1.0":
            return  # not a ZAP request: zmq never sends one; nothing to answer
        mechanism, credentials = request[5], request[6:]
        ok = (
            mechanism == b"PLAIN"
            and len(credentials) == 2
            and _valid(self._key, credentials[0], credentials[1])
        )
        status = (b"200", b"OK") if ok else (b"400", b"no valid gate token")
        if ok:
            self._admitted.append(time.monotonic())
        else:
            # Connections that are not zmq at all, or send a part above chunk_bytes, are
            # dropped by zmq before they get here, uncounted: zmq does not report them.
            self._count_drop(_GATE_PEER, DropReason.GATE)
        self._zap.send_multipart([b"1.0", request[1], *status, b"", b""])

    def _cut_excess(self) -> None:
        now = time.monotonic()
        since = now - self._limits.handshake_s
        while self._admitted and self._admitted[0] < since:
            self._admitted.popleft()
        recent = [fd for fd, accepted in self._open.items() if accepted >= since]
        excess = len(recent) - len(self._admitted) - self._limits.max_pending
        for fd in reversed(recent[len(recent) - max(0, excess) :]):
            del self._open[fd]
            if self._cut(fd):
                self._count_drop(_GATE_PEER, DropReason.PENDING)

    def _cut(self, fd: int) -> bool:
        """Shut down the TCP connection behind zmq's descriptor ``fd``, if it still is one to
        this listener's port (zmq may have closed it, and the number gone to another file)."""
        try:
            dup = os.dup(fd)
        except OSError:
            return False
        try:
            conn = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            return False
        with conn:
            try:
                if conn.type != socket.SOCK_STREAM or conn.getsockname()[1] != self._port:
                    return False
                conn.getpeername()  # the listening socket itself has no peer
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                return False
        return True

    def close(self) -> None:
        """Close the gate's sockets (before the listening socket and its context)."""
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._zap.close(linger=0)
