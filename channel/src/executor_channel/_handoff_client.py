"""The worker's side of the ring handoff: :func:`receive_fds` takes one worker's
descriptors from the driver's :class:`~._handoff_server.RingHandoff`, through the handshake of
:mod:`._handoff`, once the driver proved it holds the key."""

from __future__ import annotations

import array
import contextlib
import hmac
import os
import secrets
import socket
import time

from ._handoff import (
    CHALLENGE_BYTES,
    CLIENT_LABEL,
    INDEX,
    MAGIC,
    NFDS,
    NONCE_BYTES,
    OK,
    READY,
    REFUSALS,
    SERVER_LABEL,
    VERDICT_BYTES,
    check_index,
    check_key,
    handshake_mac,
    peer_ids,
)
from ._node_rings import WorkerFds

__all__ = ["HandoffError", "HandoffTimeoutError", "receive_fds"]


class HandoffError(ConnectionError):
    """:func:`receive_fds` failed: nothing listens, the handshake was refused or broke, or
    the server did not prove it holds the key. No descriptor was kept."""


class HandoffTimeoutError(HandoffError, TimeoutError):
    """:func:`receive_fds` did not finish within its timeout."""


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
        INDEX.size, socket.CMSG_SPACE(NFDS * 4), socket.MSG_CMSG_CLOEXEC
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
    check_key(key)
    check_index(index)
    deadline = time.monotonic() + timeout
    fds: list[int] = []
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _connect(sock, name, deadline, address)
        _pid, uid = peer_ids(sock)
        if uid != os.geteuid():
            raise HandoffError(f"the ring handoff at {address} runs as uid {uid}, not ours")
        challenge = _recv_exact(sock, CHALLENGE_BYTES, deadline, address)
        if challenge[: len(MAGIC)] != MAGIC:
            raise HandoffError(f"{address} is not a ring handoff of this version")
        server_nonce = challenge[len(MAGIC) :]
        client_nonce = secrets.token_bytes(NONCE_BYTES)
        index_bytes = INDEX.pack(index)
        request = handshake_mac(key, CLIENT_LABEL, server_nonce, client_nonce, index_bytes)
        _settimeout(sock, deadline)
        sock.sendall(client_nonce + index_bytes + request)
        verdict = _recv_exact(sock, VERDICT_BYTES, deadline, address)
        if verdict[0] != OK:
            why = REFUSALS.get(verdict[0], f"unknown refusal code {verdict[0]}")
            raise HandoffError(f"the ring handoff at {address} refused worker {index}: {why}")
        proof = handshake_mac(key, SERVER_LABEL, server_nonce, client_nonce, index_bytes)
        if not hmac.compare_digest(verdict[1:], proof):
            raise HandoffError(
                f"the process at {address} did not prove that it holds the key: "
                "not taking descriptors from it"
            )
        _settimeout(sock, deadline)
        sock.sendall(READY)
        data = _recv_fds(sock, deadline, fds)
        if not data:
            raise HandoffError(f"the ring handoff at {address} hung up instead of sending")
        if len(data) < INDEX.size:
            data += _recv_exact(sock, INDEX.size - len(data), deadline, address)
        if data != index_bytes or len(fds) != NFDS:
            raise HandoffError(
                f"the ring handoff at {address} sent {len(fds)} descriptors for worker "
                f"{INDEX.unpack(data)[0]}; expected {NFDS} for worker {index}"
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
