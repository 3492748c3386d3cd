"""Handing a node's ring descriptors to processes that are not the driver's children.

A worker started by the driver inherits the descriptors of its :class:`NodeRings` (an
unlinked shared-memory file and eventfds). A process started otherwise on the same machine
(a Ray actor, say) cannot: the driver offers them with a :class:`RingHandoff`, a Linux
abstract Unix socket, and the process takes its share with :func:`receive_fds`, which
receives them over that socket as ``SCM_RIGHTS`` ancillary data.

Address: ``"@executor-handoff-"`` followed by 32 random hex digits. The ``@`` stands for the
leading NUL byte of an abstract socket name (as ``ss -x`` prints it): the name is no file,
leaves nothing behind and vanishes with the socket, but it carries no permissions either (any
process in the same network namespace may connect). Hence two checks before any descriptor
leaves the driver: the peer's ``SO_PEERCRED`` uid must be the driver's, and the peer must
prove it holds ``key``.

Handshake, fixed-size messages only (``I`` is the worker index, u64 little-endian; ``Ns``,
``Nc`` 32 fresh random bytes from the server and the client; ``K`` the key)::

    client (worker)                                   server (driver)
      connect                             ---->   SO_PEERCRED uid == its own, else hang up
                  <----  MAGIC (8) + Ns (32)
      Nc (32) + I (8) + HMAC(K, "executor-handoff" + Ns + Nc + I)  ---->
                  <----  OK (1) + HMAC(K, "executor-handoff-reply" + Ns + Nc + I)
                         or a refusal code (1) + 32 zero bytes, and hang up
      checks the server's HMAC, then READY (1)  ---->
                  <----  I (8) with the 5 descriptors as SCM_RIGHTS, and hang up

Both MACs bind both nonces, so neither side's message can be replayed from another
handshake, and their labels differ, so one cannot be reflected as the other. The client asks
for its descriptors only once the server proved it holds the key: a process posing as the
driver never gets to install descriptors in a worker. Each index is handed over once. The
server reads the peer's bytes with plain ``recv`` (descriptors a peer attaches are discarded
by the kernel), only compares or ``struct``-unpacks them, and never unpickles anything.

The key travels to the worker by a channel the driver already trusts (an actor's constructor
arguments, say); the socket never carries it.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import selectors
import socket
import struct
import time
from collections.abc import Callable, Mapping

from executor_core import ExecutorError

from ._node_rings import WorkerFds

__all__ = [
    "CHECK_INTERVAL_S",
    "HANDSHAKE_TIMEOUT_S",
    "MIN_KEY_BYTES",
    "HandoffError",
    "HandoffTimeoutError",
    "RingHandoff",
    "receive_fds",
]

logger = logging.getLogger("executor_channel")

#: Seconds a peer has from its connection to the end of its handshake; a slower one is dropped.
HANDSHAKE_TIMEOUT_S = 5.0
#: :meth:`RingHandoff.serve` calls its ``check`` at least this often.
CHECK_INTERVAL_S = 0.5
#: The shortest key accepted (use 32 random bytes: ``secrets.token_bytes(32)``).
MIN_KEY_BYTES = 16

_PREFIX = "executor-handoff-"
_MAGIC = b"EXHOFF\x00\x01"  # protocol name and version
_NONCE_BYTES = 32
_MAC_BYTES = 32
_INDEX = struct.Struct("<Q")
_CLIENT_LABEL = b"executor-handoff"
_SERVER_LABEL = b"executor-handoff-reply"
_CHALLENGE_BYTES = len(_MAGIC) + _NONCE_BYTES
_HELLO_BYTES = _NONCE_BYTES + _INDEX.size + _MAC_BYTES
_VERDICT_BYTES = 1 + _MAC_BYTES
_READY = b"\x01"
_NFDS = 5
_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
_NO_MAC = bytes(_MAC_BYTES)

# Verdict codes (the first byte of the server's answer to a request).
_OK = 0
_BAD_KEY = 1
_UNKNOWN_INDEX = 2
_TAKEN = 3
_REFUSALS = {
    _BAD_KEY: "the key did not match (wrong key)",
    _UNKNOWN_INDEX: "it offers no descriptors for this worker index",
    _TAKEN: "this worker index's descriptors were already handed to another process",
}

# Peers in mid-handshake at once; more wait in the listen backlog (bounds the driver's fds).
_MAX_PENDING = 64
# Dropped peers that get their own warning; one more warning says the rest go to debug, so a
# flood of connections cannot flood the log.
_MAX_WARNINGS = 64


class HandoffError(ConnectionError):
    """:func:`receive_fds` failed: nothing listens, the handshake was refused or broke, or
    the server did not prove it holds the key. No descriptor was kept."""


class HandoffTimeoutError(HandoffError, TimeoutError):
    """:func:`receive_fds` did not finish within its timeout."""


def _mac(key: bytes, label: bytes, server_nonce: bytes, client_nonce: bytes, index: bytes) -> bytes:
    return hmac.new(key, label + server_nonce + client_nonce + index, hashlib.sha256).digest()


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) < MIN_KEY_BYTES:
        raise ValueError(f"the handoff key must be bytes, at least {MIN_KEY_BYTES} of them")


def _check_index(index: int) -> None:
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < 1 << 64:
        raise ValueError(f"a worker index is an int in [0, 2**64), not {index!r}")


def _peer_ids(sock: socket.socket) -> tuple[int, int]:
    """The peer's pid and effective uid when it connected (or listened)."""
    pid, uid, _gid = _UCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    )
    return pid, uid


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
        self.want = _HELLO_BYTES
        #: The index reserved for this peer once its request was accepted.
        self.index: int | None = None


class RingHandoff:
    """The driver's side: offers worker ``index`` its WorkerFds, once, to a peer that proves
    it holds ``key``.

    Binds a Linux abstract Unix socket under a random name (:attr:`address`) and listens;
    :meth:`serve` answers the workers, each running :func:`receive_fds` with the same key.
    A peer is served only if it runs under this process's uid (``SO_PEERCRED``) and passes
    the HMAC-SHA256 challenge-response of the module docstring. The offered descriptors stay
    the caller's (its :class:`NodeRings` closes them); :meth:`close` closes only the socket.

    ``key``: bytes, at least :data:`MIN_KEY_BYTES` (32 random bytes recommended), given to
    the workers by a channel the caller trusts. ``offers``: the worker indices to hand over
    and their descriptors (``{i: nodes.worker_fds(i) for i in ...}``).

    Not thread-safe: call :meth:`serve` from one thread, and :meth:`close` after it returned.
    """

    def __init__(self, key: bytes, offers: Mapping[int, WorkerFds]) -> None:
        _check_key(key)
        for index in offers:
            _check_index(index)
        self._key = key
        self._offers = dict(offers)
        self._taken: set[int] = set()
        self._reserved: set[int] = set()
        self._uid = os.geteuid()
        self._warnings = 0
        self._name = _PREFIX + secrets.token_hex(16)
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
            pid, uid = _peer_ids(sock)
            if uid != self._uid:
                self._warn(pid, f"it runs as uid {uid}, not {self._uid}")
                sock.close()
                return
            peer = _Peer(
                sock,
                pid,
                secrets.token_bytes(_NONCE_BYTES),
                time.monotonic() + HANDSHAKE_TIMEOUT_S,
            )
            selector.register(sock, selectors.EVENT_READ, peer)
        except BaseException:
            sock.close()
            raise
        peers[sock.fileno()] = peer
        self._send(selector, peers, peer, _MAGIC + peer.nonce)

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
        client_nonce = message[:_NONCE_BYTES]
        index_bytes = message[_NONCE_BYTES : _NONCE_BYTES + _INDEX.size]
        mac = message[_NONCE_BYTES + _INDEX.size :]
        (index,) = _INDEX.unpack(index_bytes)
        expected = _mac(self._key, _CLIENT_LABEL, peer.nonce, client_nonce, index_bytes)
        if not hmac.compare_digest(mac, expected):
            code, why = _BAD_KEY, "it failed the authentication (wrong key)"
        elif index not in self._offers:
            code, why = _UNKNOWN_INDEX, f"it asked for worker index {index}, which is not offered"
        elif index in self._taken or index in self._reserved:
            code, why = _TAKEN, f"it asked for worker index {index}, already handed over"
        else:
            proof = _mac(self._key, _SERVER_LABEL, peer.nonce, client_nonce, index_bytes)
            if self._send(selector, peers, peer, bytes([_OK]) + proof):
                peer.index = index
                peer.want = len(_READY)
                self._reserved.add(index)
            return
        # Tell it why (best effort: it is dropped either way, with this reason).
        with contextlib.suppress(OSError):
            peer.sock.send(bytes([code]) + _NO_MAC, socket.MSG_NOSIGNAL | socket.MSG_DONTWAIT)
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
        if message != _READY:
            self._drop(selector, peers, peer, "it sent garbage after its request was accepted")
            return
        fds = self._offers[index].as_tuple()
        if self._send(selector, peers, peer, _INDEX.pack(index), fds):
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


# --- the worker's side -----------------------------------------------------------------


def _abstract_name(address: str) -> str:
    if not isinstance(address, str) or not address.startswith("@") or len(address) < 2:
        raise ValueError(
            f"a ring handoff address is an abstract socket name starting with '@', not {address!r}"
        )
    return "\0" + address[1:]


def _settimeout(sock: socket.socket, deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("timed out")
    sock.settimeout(remaining)


def _connect(sock: socket.socket, name: str, deadline: float, address: str) -> None:
    # A Unix socket's connect does not wait for room in a full listen backlog (EAGAIN, even
    # with a timeout): wait here, briefly, as the server takes its peers in turn.
    pause = 0.001
    while True:
        _settimeout(sock, deadline)
        try:
            sock.connect(name)
            return
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise HandoffError(
                f"nothing listens at {address} (the driver closed its ring handoff, or this "
                "process runs in another network namespace)"
            ) from exc
        except BlockingIOError:
            time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
            pause = min(2 * pause, 0.05)


def _recv_exact(sock: socket.socket, nbytes: int, deadline: float, address: str) -> bytes:
    """``nbytes`` bytes, read with plain ``recv`` (descriptors sent along are discarded)."""
    data = bytearray()
    while len(data) < nbytes:
        _settimeout(sock, deadline)
        chunk = sock.recv(nbytes - len(data))
        if not chunk:
            raise HandoffError(
                f"the ring handoff at {address} hung up during the handshake (it refused this "
                "process's uid, gave up on it, or stopped serving)"
            )
        data += chunk
    return bytes(data)


def _recv_fds(sock: socket.socket, deadline: float, fds: list[int]) -> bytes:
    """The first bytes of the last message, and its descriptors (appended to ``fds`` as soon
    as they exist in this process, so the caller closes them on any error)."""
    _settimeout(sock, deadline)
    data, ancillary, flags, _ = sock.recvmsg(
        _INDEX.size, socket.CMSG_SPACE(_NFDS * 4), socket.MSG_CMSG_CLOEXEC
    )
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            received = array.array("i")
            received.frombytes(payload[: len(payload) - len(payload) % received.itemsize])
            fds.extend(received)
    if flags & socket.MSG_CTRUNC:
        raise HandoffError("the ring handoff sent more descriptors than a worker takes")
    return data


def receive_fds(address: str, key: bytes, index: int, timeout: float) -> WorkerFds:
    """The worker's side: take worker ``index``'s ring descriptors from the
    :class:`RingHandoff` at ``address`` (its :attr:`~RingHandoff.address`), proving ``key``.

    Connects, checks that the server runs under this process's uid, answers its challenge,
    checks the server's proof that it holds the key, and only then asks for and receives
    exactly 5 descriptors (close-on-exec), which now belong to the caller (pass them to
    :meth:`WorkerRings.attach`). Raises :class:`HandoffError` (an :class:`OSError`) with the
    reason on failure, :class:`HandoffTimeoutError` if it did not finish within ``timeout``
    seconds, :class:`ValueError` for a malformed address, key or index; on any error, no
    descriptor stays open.
    """
    name = _abstract_name(address)
    _check_key(key)
    _check_index(index)
    deadline = time.monotonic() + timeout
    fds: list[int] = []
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _connect(sock, name, deadline, address)
        _pid, uid = _peer_ids(sock)
        if uid != os.geteuid():
            raise HandoffError(f"the ring handoff at {address} runs as uid {uid}, not ours")
        challenge = _recv_exact(sock, _CHALLENGE_BYTES, deadline, address)
        if challenge[: len(_MAGIC)] != _MAGIC:
            raise HandoffError(f"{address} is not a ring handoff of this version")
        server_nonce = challenge[len(_MAGIC) :]
        client_nonce = secrets.token_bytes(_NONCE_BYTES)
        index_bytes = _INDEX.pack(index)
        request = _mac(key, _CLIENT_LABEL, server_nonce, client_nonce, index_bytes)
        _settimeout(sock, deadline)
        sock.sendall(client_nonce + index_bytes + request)
        verdict = _recv_exact(sock, _VERDICT_BYTES, deadline, address)
        if verdict[0] != _OK:
            why = _REFUSALS.get(verdict[0], f"unknown refusal code {verdict[0]}")
            raise HandoffError(f"the ring handoff at {address} refused worker {index}: {why}")
        proof = _mac(key, _SERVER_LABEL, server_nonce, client_nonce, index_bytes)
        if not hmac.compare_digest(verdict[1:], proof):
            raise HandoffError(
                f"the process at {address} did not prove that it holds the key: "
                "not taking descriptors from it"
            )
        _settimeout(sock, deadline)
        sock.sendall(_READY)
        data = _recv_fds(sock, deadline, fds)
        if not data:
            raise HandoffError(f"the ring handoff at {address} hung up instead of sending")
        if len(data) < _INDEX.size:
            data += _recv_exact(sock, _INDEX.size - len(data), deadline, address)
        if data != index_bytes or len(fds) != _NFDS:
            raise HandoffError(
                f"the ring handoff at {address} sent {len(fds)} descriptors for worker "
                f"{_INDEX.unpack(data)[0]}; expected {_NFDS} for worker {index}"
            )
        return WorkerFds(
            segment=fds[0],
            call_bell=fds[1],
            call_space_bell=fds[2],
            reply_bell=fds[3],
            reply_space_bell=fds[4],
        )
    except HandoffError:
        _close_all(fds)
        raise
    except TimeoutError as exc:
        _close_all(fds)
        raise HandoffTimeoutError(
            f"taking worker {index}'s ring descriptors from {address} did not finish within "
            f"{timeout:g} s"
        ) from exc
    except OSError as exc:
        _close_all(fds)
        raise HandoffError(
            f"taking worker {index}'s ring descriptors from {address} failed: {exc}"
        ) from exc
    except BaseException:
        _close_all(fds)
        raise
    finally:
        sock.close()


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()
