"""Direct calls: a Unix socket from the driver to each worker on the driver's node.

A Ray actor call costs about 0.7 ms here when every process is busy and about 2 ms after the
processes went idle (a model step's gap), most of it in hops between Ray's threads and
processes. On one node the executor sends small calls on a socket of its own instead: the
worker's thread blocks in ``recv`` (no spinning), runs the call and answers on the same
socket, one wake-up each way, as the multiproc backend does.

Security: each worker listens on an abstract Unix socket (no file to leak), and both ends
prove they hold a random key, sent to the worker through Ray (whose own channel is
authenticated), before anything is unpickled (``multiprocessing.connection``'s HMAC
challenge, both ways).

Messages: a call is ``seq`` (8 bytes) and the call pickled by :func:`~._encoding.pack`; a
reply is ``seq``, a kind byte, and either the pickled result or the pickled non-bytes reply
(``None``, :class:`~._encoding.Failed`, :class:`~._encoding.Carried`).
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import struct
import threading
import time
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from ._encoding import decode_reply

__all__ = ["ChannelClosedError", "DirectChannels", "DirectServer"]

logger = logging.getLogger("executor_plugin_ray")

_SEQ = struct.Struct("<Q")
_RESULT = b"\x00"  # the payload is the result, pickled
_OTHER = b"\x01"  # the payload is a pickled reply object (None, Failed, Carried)


def _connect(address: str, authkey: bytes, timeout_s: float) -> Connection:
    """``Client(address)`` with a time limit: its handshake has none, and a local process that
    connected to the worker first and stalls would hold ours forever. On timeout the helper
    thread stays blocked until that process lets go; the executor goes on without it."""
    outcome: list[Connection | BaseException] = []

    def connect() -> None:
        try:
            outcome.append(Client(address, family="AF_UNIX", authkey=authkey))
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
    """The worker's end: accepts the driver (after authentication) and serves its calls on a
    daemon thread, one at a time, until the driver closes the socket."""

    def __init__(self, authkey: bytes, handle: Callable[[bytes], Any]) -> None:
        self.address = f"\0executor-ray-{os.getpid()}-{os.urandom(8).hex()}"
        self._listener = Listener(self.address, family="AF_UNIX", authkey=authkey)
        self._handle = handle
        self._thread = threading.Thread(target=self._serve, name="executor-ray-direct", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn = self._accept()
        if conn is None:
            return
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

    def _accept(self) -> Connection | None:
        try:
            while True:
                try:
                    return self._listener.accept()
                except AuthenticationError:
                    logger.warning("refused a connection to the direct channel: wrong key")
                except OSError:
                    return None
        finally:
            self._listener.close()


class DirectChannels:
    """The driver's end: one authenticated socket per rank."""

    def __init__(self, addresses: list[str], authkey: bytes, timeout_s: float) -> None:
        """Connect to every rank; ``OSError`` (``TimeoutError`` after ``timeout_s`` seconds
        for one rank) if one cannot be reached or does not complete the handshake."""
        self._conns: list[Connection] = []
        try:
            for address in addresses:
                self._conns.append(_connect(address, authkey, timeout_s))
        except BaseException:
            self.close()
            raise

    def send(self, seq: int, call: bytes) -> None:
        """Send one call to every rank (the caller holds the submission lock)."""
        message = _SEQ.pack(seq) + call
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(message)
            except OSError:
                raise ChannelClosedError(rank) from None

    def read(
        self,
        rank: int,
        seq: int,
        deadline: float | None,
        slice_s: float,
        check: Callable[[], None],
    ) -> tuple[bool, Any]:
        """``(True, reply)`` for call ``seq`` from ``rank``, or ``(False, None)`` at the
        deadline. Replies of earlier calls that timed out are skipped. ``check`` runs between
        slices of waiting and raises to stop it (executor failed or closed)."""
        conn = self._conns[rank]
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False, None
            wait_s = slice_s if remaining is None else min(slice_s, remaining)
            try:
                ready = conn.poll(wait_s)
                data = conn.recv_bytes() if ready else None
            except (EOFError, OSError):
                raise ChannelClosedError(rank) from None
            if data is None:
                check()
                continue
            (got,) = _SEQ.unpack_from(data)
            if got < seq:
                continue  # the reply to a call that timed out
            payload = memoryview(data)[_SEQ.size + 1 :]
            if data[_SEQ.size : _SEQ.size + 1] == _RESULT:
                return True, pickle.loads(payload)
            return True, decode_reply(pickle.loads(payload))

    def answered(self, rank: int) -> bool:
        """True if a reply from ``rank`` is waiting to be read."""
        try:
            return self._conns[rank].poll(0)
        except (EOFError, OSError):
            return False

    def close(self) -> None:
        """Close every socket; the workers' threads then exit, and a driver thread waiting
        for a reply wakes up (``shutdown`` first: closing alone would not wake it)."""
        for conn in self._conns:
            try:
                with socket.socket(fileno=os.dup(conn.fileno())) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed
            conn.close()
        self._conns = []
