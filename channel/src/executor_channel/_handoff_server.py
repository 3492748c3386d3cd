"""The driver's side of the ring handoff: a :class:`RingHandoff` serves its offered
descriptors to the workers that pass the handshake of :mod:`._handoff`, many at once, in one
thread that sleeps in ``select``."""

from __future__ import annotations

import array
import contextlib
import hmac
import logging
import os
import secrets
import selectors
import socket
import time
from collections.abc import Callable, Mapping

from executor_core import ExecutorError

from ._handoff import (
    BAD_KEY,
    CLIENT_LABEL,
    HELLO_BYTES,
    INDEX,
    MAGIC,
    NO_MAC,
    NONCE_BYTES,
    OK,
    PREFIX,
    READY,
    SERVER_LABEL,
    TAKEN,
    UNKNOWN_INDEX,
    check_index,
    check_key,
    handshake_mac,
    peer_ids,
)
from ._node_rings import WorkerFds

__all__ = ["CHECK_INTERVAL_S", "HANDSHAKE_TIMEOUT_S", "RingHandoff"]

logger = logging.getLogger("executor_channel")

#: Seconds a peer has from its connection to the end of its handshake; a slower one is dropped.
HANDSHAKE_TIMEOUT_S = 5.0
#: :meth:`RingHandoff.serve` calls its ``check`` at least this often.
CHECK_INTERVAL_S = 0.5

# Peers in mid-handshake at once; more wait in the listen backlog (bounds the driver's fds).
_MAX_PENDING = 64
# Dropped peers that get their own warning; one more warning says the rest go to debug, so a
# flood of connections cannot flood the log.
_MAX_WARNINGS = 64


def _no_check() -> None:
    return None


class _Peer:
    """A connection in mid-handshake, as the server sees it."""

    __slots__ = ("deadline", "inbox", "index", "nonce", "pid", "sock", "want")

    def __init__(self, sock: socket.socket, pid: int, nonce: bytes, deadline: float) -> None:
        self.sock = sock
        self.pid = pid
        self.nonce = nonce
        self.deadline = deadline
        self.inbox = bytearray()
        #: The message awaited: the request, then (once accepted) the ready byte.
        self.want = HELLO_BYTES
        #: The index reserved for this peer once its request was accepted.
        self.index: int | None = None


class RingHandoff:
    """The driver's side: offers worker ``index`` its WorkerFds, once, to a peer that proves
    it holds ``key``.

    Binds a Linux abstract Unix socket under a random name (:attr:`address`) and listens;
    :meth:`serve` answers the workers, each running :func:`receive_fds` with the same key.
    A peer is served only if it runs under this process's uid (``SO_PEERCRED``) and passes
    the HMAC-SHA256 challenge-response of :mod:`._handoff`. The offered descriptors stay
    the caller's (its :class:`NodeRings` closes them); :meth:`close` closes only the socket.

    ``key``: bytes, at least :data:`MIN_KEY_BYTES` (32 random bytes recommended), given to
    the workers by a channel the caller trusts. ``offers``: the worker indices to hand over
    and their descriptors (``{i: nodes.worker_fds(i) for i in ...}``).

    Not thread-safe: call :meth:`serve` from one thread, and :meth:`close` after it returned.
    """

    def __init__(self, key: bytes, offers: Mapping[int, WorkerFds]) -> None:
        check_key(key)
        for index in offers:
            check_index(index)
        self._key = key
        self._offers = dict(offers)
        self._taken: set[int] = set()
        self._reserved: set[int] = set()
        self._uid = os.geteuid()
        self._warnings = 0
        self._name = PREFIX + secrets.token_hex(16)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.bind("\0" + self._name)
            sock.listen(socket.SOMAXCONN)
        except BaseException:
            sock.close()
            raise
        self._listener: socket.socket | None = sock

    @property
    def address(self) -> str:
        """The socket's abstract name for :func:`receive_fds`: ``"@executor-handoff-"`` and 32
        hex digits, ``@`` standing for the name's leading NUL byte. Valid on this machine, in
        this network namespace, until :meth:`close`."""
        return "@" + self._name

    def serve(self, deadline: float, check: Callable[[], None] = _no_check) -> None:
        """Hand over every offered index, each to the first peer that proves the key and asks
        for it; return once all were taken.

        Peers are served concurrently: one that runs under another uid, fails the
        authentication, asks for an index not offered or already taken, hangs up, or does not
        finish its handshake within :data:`HANDSHAKE_TIMEOUT_S` is dropped (one warning on the
        ``executor_channel`` logger) and does not hold up the others; an index it had asked
        for is offered again. Sleeps in ``select`` (no busy wait) at most until ``deadline``
        (a :func:`time.monotonic` time) and calls ``check`` at least every
        :data:`CHECK_INTERVAL_S`; an exception from ``check`` aborts and propagates.

        Raises :class:`ExecutorError` naming the indices not taken once ``deadline`` passed.
        May be called again after that to go on serving the rest.
        """
        listener = self._listener
        if listener is None:
            raise ExecutorError("this ring handoff is closed")
        selector = selectors.DefaultSelector()
        peers: dict[int, _Peer] = {}
        try:
            selector.register(listener, selectors.EVENT_READ, None)
            listening = True
            while self._missing():
                check()
                now = time.monotonic()
                for peer in [p for p in peers.values() if p.deadline <= now]:
                    self._drop(
                        selector,
                        peers,
                        peer,
                        f"it did not finish its handshake within {HANDSHAKE_TIMEOUT_S:g} s",
                    )
                if now >= deadline:
                    missing = self._missing()
                    raise ExecutorError(
                        f"worker index(es) {missing} did not take their shared-memory ring "
                        f"descriptors from the driver (at {self.address}) in time: did those "
                        "workers start, on this machine, with the right key?"
                    )
                if listening != (len(peers) < _MAX_PENDING):
                    listening = not listening
                    if listening:
                        selector.register(listener, selectors.EVENT_READ, None)
                    else:
                        selector.unregister(listener)
                wake = min(deadline, now + CHECK_INTERVAL_S, *(p.deadline for p in peers.values()))
                for selected, _events in selector.select(max(0.0, wake - now)):
                    if selected.data is None:
                        self._accept(listener, selector, peers)
                    else:
                        self._on_readable(selector, peers, selected.data)
        finally:
            for peer in list(peers.values()):
                self._release(selector, peers, peer)
            selector.close()

    def close(self) -> None:
        """Close the listening socket (its name goes with it). Idempotent; the offered
        descriptors stay open."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()

    # --- the server's steps ------------------------------------------------------------

    def _missing(self) -> list[int]:
        return sorted(set(self._offers) - self._taken)

    def _accept(
        self, listener: socket.socket, selector: selectors.BaseSelector, peers: dict[int, _Peer]
    ) -> None:
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, ConnectionAbortedError):
            return  # gone before we got to it
        try:
            sock.setblocking(False)
            pid, uid = peer_ids(sock)
            if uid != self._uid:
                self._warn(pid, f"it runs as uid {uid}, not {self._uid}")
                sock.close()
                return
            peer = _Peer(
                sock,
                pid,
                secrets.token_bytes(NONCE_BYTES),
                time.monotonic() + HANDSHAKE_TIMEOUT_S,
            )
            selector.register(sock, selectors.EVENT_READ, peer)
        except BaseException:
            sock.close()
            raise
        peers[sock.fileno()] = peer
        self._send(selector, peers, peer, MAGIC + peer.nonce)

    def _send(
        self,
        selector: selectors.BaseSelector,
        peers: dict[int, _Peer],
        peer: _Peer,
        data: bytes,
        fds: tuple[int, ...] = (),
    ) -> bool:
        """Send one whole message at once, or drop the peer. Every message is small and the
        peer has read all earlier ones before it answered, so a healthy peer's socket buffer
        always has room: a short or refused send means a misbehaving peer."""
        flags = socket.MSG_NOSIGNAL | socket.MSG_DONTWAIT
        try:
            if fds:
                ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                sent = peer.sock.sendmsg([data], ancillary, flags)
            else:
                sent = peer.sock.send(data, flags)
        except (BlockingIOError, ConnectionError) as exc:
            self._drop(selector, peers, peer, f"sending to it failed ({exc})")
            return False
        if sent != len(data):
            self._drop(selector, peers, peer, "its socket did not take a whole message")
            return False
        return True

    def _on_readable(
        self, selector: selectors.BaseSelector, peers: dict[int, _Peer], peer: _Peer
    ) -> None:
        try:
            data = peer.sock.recv(peer.want - len(peer.inbox))
        except BlockingIOError:
            return
        except ConnectionError as exc:
            self._drop(selector, peers, peer, f"its connection broke ({exc})")
            return
        if not data:
            self._drop(selector, peers, peer, "it hung up during the handshake")
            return
        peer.inbox += data
        if len(peer.inbox) < peer.want:
            return
        message = bytes(peer.inbox)
        peer.inbox.clear()
        if peer.index is None:
            self._on_request(selector, peers, peer, message)
        else:
            self._on_ready(selector, peers, peer, message)

    def _on_request(
        self,
        selector: selectors.BaseSelector,
        peers: dict[int, _Peer],
        peer: _Peer,
        message: bytes,
    ) -> None:
        client_nonce = message[:NONCE_BYTES]
        index_bytes = message[NONCE_BYTES : NONCE_BYTES + INDEX.size]
        mac = message[NONCE_BYTES + INDEX.size :]
        (index,) = INDEX.unpack(index_bytes)
        expected = handshake_mac(self._key, CLIENT_LABEL, peer.nonce, client_nonce, index_bytes)
        if not hmac.compare_digest(mac, expected):
            code, why = BAD_KEY, "it failed the authentication (wrong key)"
        elif index not in self._offers:
            code, why = UNKNOWN_INDEX, f"it asked for worker index {index}, which is not offered"
        elif index in self._taken or index in self._reserved:
            code, why = TAKEN, f"it asked for worker index {index}, already handed over"
        else:
            proof = handshake_mac(self._key, SERVER_LABEL, peer.nonce, client_nonce, index_bytes)
            if self._send(selector, peers, peer, bytes([OK]) + proof):
                peer.index = index
                peer.want = len(READY)
                self._reserved.add(index)
            return
        # Tell it why (best effort: it is dropped either way, with this reason).
        with contextlib.suppress(OSError):
            peer.sock.send(bytes([code]) + NO_MAC, socket.MSG_NOSIGNAL | socket.MSG_DONTWAIT)
        self._drop(selector, peers, peer, why)

    def _on_ready(
        self,
        selector: selectors.BaseSelector,
        peers: dict[int, _Peer],
        peer: _Peer,
        message: bytes,
    ) -> None:
        index = peer.index
        assert index is not None
        if message != READY:
            self._drop(selector, peers, peer, "it sent garbage after its request was accepted")
            return
        fds = self._offers[index].as_tuple()
        if self._send(selector, peers, peer, INDEX.pack(index), fds):
            self._taken.add(index)
            logger.debug("handed worker %d's ring descriptors to pid %d", index, peer.pid)
            self._release(selector, peers, peer)

    def _drop(
        self, selector: selectors.BaseSelector, peers: dict[int, _Peer], peer: _Peer, why: str
    ) -> None:
        if peer.sock.fileno() < 0:
            return  # already dropped (a failed send drops its peer)
        self._warn(peer.pid, why)
        self._release(selector, peers, peer)

    def _release(
        self, selector: selectors.BaseSelector, peers: dict[int, _Peer], peer: _Peer
    ) -> None:
        """Forget a peer and close its socket; an index it reserved is offered again."""
        fd = peer.sock.fileno()
        if fd < 0:
            return
        if peer.index is not None:
            self._reserved.discard(peer.index)
        peers.pop(fd, None)
        selector.unregister(peer.sock)
        peer.sock.close()

    def _warn(self, pid: int, why: str) -> None:
        self._warnings += 1
        if self._warnings <= _MAX_WARNINGS:
            logger.warning("ring handoff %s dropped a process (pid %d): %s", self.address, pid, why)
            if self._warnings == _MAX_WARNINGS:
                logger.warning(
                    "ring handoff %s: further drops are logged at debug level", self.address
                )
        else:
            logger.debug("ring handoff %s dropped a process (pid %d): %s", self.address, pid, why)
