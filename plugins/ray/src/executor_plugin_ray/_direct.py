"""Direct calls: the driver's own socket to each worker.

A Ray actor call costs about 0.7 ms here when every process is busy and about 2 ms after the
processes went idle (a model step's gap), most of it in hops between Ray's threads and
processes. The executor sends small calls on a socket of its own instead: the worker's
thread blocks in ``recv`` (no spinning), runs the call and answers on the same socket, one
wake-up each way, as the multiproc backend does. A worker on the driver's node listens on an
abstract Unix socket (no file to leak); one on another node, only when the user turns that
on (``direct_calls_across_nodes``), on TCP at its node's IP.

Security: both ends prove they hold a random key, sent to the worker through Ray (whose own
channel is authenticated), before anything is unpickled (``multiprocessing.connection``'s
HMAC challenge, both ways). A worker runs each handshake on a thread of its own and drops a
peer that has not completed it in :data:`HANDSHAKE_S`, so a peer that connects and stalls
cannot lock the driver out; the first peer to pass is the driver, and the worker then stops
listening. After the handshake the bytes are not encrypted, as Ray's own traffic is not by
default.

Messages: a call is ``seq`` (8 bytes) and the call pickled by :func:`~._encoding.pack`; a
reply is ``seq``, a kind byte, and either the pickled result or the pickled non-bytes reply
(``None``, :class:`~._encoding.Failed`, :class:`~._encoding.Carried`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import select
import socket
import struct
import threading
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from typing import Any

from ._encoding import decode_reply

__all__ = ["HANDSHAKE_S", "Address", "ChannelClosedError", "DirectChannels", "DirectServer"]

logger = logging.getLogger("executor_plugin_ray")

_SEQ = struct.Struct("<Q")
_RESULT = b"\x00"  # the payload is the result, pickled
_OTHER = b"\x01"  # the payload is a pickled reply object (None, Failed, Carried)
#: A socket with a reply to read, or one that closed (recv then says so).
_READABLE = select.POLLIN | select.POLLHUP | select.POLLERR


#: An address as ``Client`` takes it: an abstract Unix socket name, or ``(host, port)``.
Address = str | tuple[str, int]

#: Seconds a peer that connected to a worker may take to complete the handshake; after that
#: the worker drops it. Handshakes run side by side, so a peer that connects and stalls
#: cannot lock the driver out in the meantime either.
HANDSHAKE_S = 10.0


def _connect(address: Address, authkey: bytes, timeout_s: float) -> Connection:
    """``Client(address)`` with a time limit: its handshake has none, and a worker that stops
    answering mid-handshake would hold the driver forever. On timeout the helper thread stays
    blocked until the worker lets go; the executor goes on without it."""
    outcome: list[Connection | BaseException] = []
    family = "AF_UNIX" if isinstance(address, str) else "AF_INET"

    def connect() -> None:
        try:
            outcome.append(Client(address, family=family, authkey=authkey))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            outcome.append(exc)

    thread = threading.Thread(target=connect, name="executor-ray-connect", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        raise TimeoutError(
            f"the worker's direct channel did not complete the handshake in {timeout_s:g} s"
        )
    result = outcome[0]
    if isinstance(result, BaseException):
        raise result
    return result


class ChannelClosedError(Exception):
    """A worker's socket closed: its actor stopped or died."""

    def __init__(self, rank: int) -> None:
        super().__init__(f"the direct channel to rank {rank} closed")
        self.rank = rank


class DirectServer:
    """The worker's end: accepts the driver (the first peer to pass the handshake) and serves
    its calls on a daemon thread, one at a time, until the driver closes the socket.

    ``host=None`` listens on an abstract Unix socket (the driver on this node); a host
    listens on TCP at that address (the worker's node IP, for a driver on another node).
    """

    def __init__(
        self, authkey: bytes, handle: Callable[[bytes], Any], host: str | None = None
    ) -> None:
        self._authkey = authkey
        self._handle = handle
        self._claimed = False
        self._claim_lock = threading.Lock()
        if host is None:
            name = f"\0executor-ray-{os.getpid()}-{os.urandom(8).hex()}"
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._listener.bind(name)
            self.address: Address = name
        else:
            self._listener = socket.create_server((host, 0))
            self.address = (host, self._listener.getsockname()[1])
        self._listener.listen()
        self._thread = threading.Thread(
            target=self._accept, name="executor-ray-direct", daemon=True
        )
        self._thread.start()

    def _accept(self) -> None:
        """Hand each connection to a handshake thread, until one of them claims the channel
        (it closes the listener, which ends this loop)."""
        with self._listener:
            while True:
                try:
                    sock, _peer = self._listener.accept()
                except OSError:
                    return  # closed: the driver is connected, or the actor is going away
                threading.Thread(
                    target=self._handshake, args=(sock,), name="executor-ray-handshake", daemon=True
                ).start()

    def _handshake(self, sock: socket.socket) -> None:
        conn = Connection(sock.detach())
        # This thread owns (and alone closes) the connection. The timer only shuts the socket
        # down, which wakes this thread; which of the two came first is decided under a lock,
        # so that a peer finishing just as the time runs out is not served a dead socket.
        decided = threading.Lock()
        outcome: list[str] = []

        def decide(what: str) -> bool:
            with decided:
                if outcome:
                    return False
                outcome.append(what)
                return True

        def drop_if_stalled() -> None:
            with decided:  # held while shutting down: this thread cannot close it meanwhile
                if not outcome:
                    outcome.append("stalled")
                    _shut_down(conn)

        timer = threading.Timer(HANDSHAKE_S, drop_if_stalled)
        timer.daemon = True
        timer.start()
        try:
            # The order of multiprocessing's Listener: challenge the peer, then answer its own.
            deliver_challenge(conn, self._authkey)
            answer_challenge(conn, self._authkey)
        except (AuthenticationError, AssertionError) as exc:
            # AssertionError: Python 3.11's answer_challenge on a message that is no challenge.
            decide("refused")
            logger.warning("refused a connection to the direct channel: %s", type(exc).__name__)
            conn.close()
            return
        except (EOFError, OSError):
            decide("gone")  # the peer went away, or stalled past HANDSHAKE_S
            conn.close()
            return
        finally:
            timer.cancel()
        if not decide("passed"):
            conn.close()  # the time ran out first
            return
        with self._claim_lock:
            claimed, self._claimed = self._claimed, True
        if claimed:
            conn.close()  # the driver is already connected; nobody else is served
            return
        # No more peers are wanted: wake accept(); its thread closes the listener.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._serve(conn)

    def _serve(self, conn: Connection) -> None:
        with conn:
            while True:
                try:
                    data = conn.recv_bytes()
                except (EOFError, OSError):
                    return  # the driver closed the channel (shutdown) or went away
                reply = self._handle(memoryview(data)[_SEQ.size :].tobytes())
                header = data[: _SEQ.size]
                if type(reply) is bytes:
                    message = header + _RESULT + reply
                else:
                    message = header + _OTHER + pickle.dumps(reply, protocol=5)
                try:
                    conn.send_bytes(message)
                except OSError:
                    return


def _shut_down(conn: Connection) -> None:
    """Shut ``conn``'s socket down, both ways: a thread blocked reading it wakes up (closing
    the descriptor alone would not wake it). Its owner still closes it."""
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed


class DirectChannels:
    """The driver's end: one authenticated socket per rank.

    One thread sends (the executor's send lock) and one reads (the core lets one thread
    read replies at a time): :meth:`wait` for the ranks with a reply ready, then :meth:`recv`
    each. Replies carry the sequence number of their call, so a reply to a call that timed
    out is told apart from the next call's.
    """

    def __init__(self, addresses: list[Address], authkey: bytes, timeout_s: float) -> None:
        """Connect to every rank; ``OSError`` (``TimeoutError`` after ``timeout_s`` seconds
        for one rank) if one cannot be reached or does not complete the handshake."""
        self._conns: list[Connection] = []
        try:
            for address in addresses:
                self._conns.append(_connect(address, authkey, timeout_s))
        except BaseException:
            self.close()
            raise
        # One poll set for the life of the channels (multiprocessing's wait() builds a
        # selector per call: several µs a call more).
        self._poller = select.poll()
        self._ranks: dict[int, int] = {}
        for rank, conn in enumerate(self._conns):
            self._poller.register(conn.fileno(), _READABLE)
            self._ranks[conn.fileno()] = rank
        self._wake: int | None = None

    def send(self, seq: int, call: bytes) -> None:
        """Send call ``seq`` to every rank."""
        message = _SEQ.pack(seq) + call
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(message)
            except OSError:
                raise ChannelClosedError(rank) from None

    def wait(self, timeout: float | None, wake: int | None = None) -> list[int]:
        """The ranks with a reply ready (or whose socket closed), waiting up to ``timeout``
        seconds for one; an empty list after the timeout, or at once when the file
        descriptor ``wake`` (always the same one) is readable. One thread at a time."""
        if wake is not None and self._wake is None:
            self._wake = wake
            self._poller.register(wake, _READABLE)
        try:
            ready = self._poller.poll(None if timeout is None else timeout * 1000.0)
        except OSError:  # interrupted or closed under us
            return []
        ranks = self._ranks
        return [ranks[fd] for fd, _events in ready if fd in ranks]

    def recv(self, rank: int) -> tuple[int, Any]:
        """``rank``'s next reply, ready after :meth:`wait` named it: the call's sequence
        number and the result, ``None`` (the rank need not answer) or a
        :class:`~._encoding.Failed`. :class:`ChannelClosedError` if the socket closed."""
        try:
            data = self._conns[rank].recv_bytes()
        except (EOFError, OSError, IndexError):
            raise ChannelClosedError(rank) from None
        (seq,) = _SEQ.unpack_from(data)
        payload = memoryview(data)[_SEQ.size + 1 :]
        if data[_SEQ.size : _SEQ.size + 1] == _RESULT:
            return seq, pickle.loads(payload)
        return seq, decode_reply(pickle.loads(payload))

    def shutdown(self) -> None:
        """Shut every socket down: a thread waiting for a reply wakes up, and the workers'
        threads exit. The sockets stay open until :meth:`close`."""
        for conn in self._conns:
            _shut_down(conn)

    def close(self) -> None:
        """Shut down and close every socket (once no thread reads them any more)."""
        conns, self._conns = self._conns, []
        for conn in conns:
            _shut_down(conn)
            conn.close()
