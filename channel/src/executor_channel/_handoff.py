"""The ring handoff's protocol: how a node's ring descriptors reach processes that are not
the driver's children.

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

This module is that protocol, as both sides speak it: the driver's
:class:`~._handoff_server.RingHandoff` and the worker's :func:`~._handoff_client.receive_fds`.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct

__all__ = [
    "BAD_KEY",
    "CHALLENGE_BYTES",
    "CLIENT_LABEL",
    "HELLO_BYTES",
    "INDEX",
    "MAGIC",
    "MIN_KEY_BYTES",
    "NFDS",
    "NONCE_BYTES",
    "NO_MAC",
    "OK",
    "PREFIX",
    "READY",
    "REFUSALS",
    "SERVER_LABEL",
    "TAKEN",
    "UNKNOWN_INDEX",
    "VERDICT_BYTES",
    "check_index",
    "check_key",
    "handshake_mac",
    "peer_ids",
]

#: The shortest key accepted (use 32 random bytes: ``secrets.token_bytes(32)``).
MIN_KEY_BYTES = 16

PREFIX = "executor-handoff-"
MAGIC = b"EXHOFF\x00\x01"  # protocol name and version
NONCE_BYTES = 32
MAC_BYTES = 32
INDEX = struct.Struct("<Q")
CLIENT_LABEL = b"executor-handoff"
SERVER_LABEL = b"executor-handoff-reply"
CHALLENGE_BYTES = len(MAGIC) + NONCE_BYTES
HELLO_BYTES = NONCE_BYTES + INDEX.size + MAC_BYTES
VERDICT_BYTES = 1 + MAC_BYTES
READY = b"\x01"
NFDS = 5
_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
NO_MAC = bytes(MAC_BYTES)

# Verdict codes (the first byte of the server's answer to a request).
OK = 0
BAD_KEY = 1
UNKNOWN_INDEX = 2
TAKEN = 3
REFUSALS = {
    BAD_KEY: "the key did not match (wrong key)",
    UNKNOWN_INDEX: "it offers no descriptors for this worker index",
    TAKEN: "this worker index's descriptors were already handed to another process",
}


def handshake_mac(
    key: bytes, label: bytes, server_nonce: bytes, client_nonce: bytes, index: bytes
) -> bytes:
    """The MAC a side sends: ``label`` (whose side) and both nonces bind it to one handshake."""
    return hmac.new(key, label + server_nonce + client_nonce + index, hashlib.sha256).digest()


def check_key(key: bytes) -> None:
    """Refuse (``ValueError``) a key that is not bytes, or shorter than :data:`MIN_KEY_BYTES`."""
    if not isinstance(key, bytes) or len(key) < MIN_KEY_BYTES:
        raise ValueError(f"the handoff key must be bytes, at least {MIN_KEY_BYTES} of them")


def check_index(index: int) -> None:
    """Refuse (``ValueError``) a worker index that :data:`INDEX` cannot carry."""
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < 1 << 64:
        raise ValueError(f"a worker index is an int in [0, 2**64), not {index!r}")


def peer_ids(sock: socket.socket) -> tuple[int, int]:
    """The peer's pid and effective uid when it connected (or listened)."""
    pid, uid, _gid = _UCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    )
    return pid, uid
