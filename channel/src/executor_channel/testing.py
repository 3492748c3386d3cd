"""Helpers for the tests of backends built on the channel.

:func:`throw_garbage` sends a listener frames that no holder of the secret made (random
bytes, truncated and pickle-looking parts, forged join requests) from several fresh
connections that passed the gate with a token an observer could have captured
(:func:`gate_token`): a backend's test runs it against its driver's listener while calls go
on, and checks that every call still succeeds and nothing was unpickled.
:func:`flood_unauthenticated` is the peer that has no token at all: it streams huge,
never-finished multipart messages and raw garbage from many connections, for a test that
measures what the listener holds meanwhile. :data:`fences` is the module through which the
rings make every access to their counters (loads, stores and fences), for a benchmark that
times those operations.
"""

from __future__ import annotations

import json
import random
import socket
import struct
import threading
import time

from ._net.secret import Secret

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from ._net.listener import Listener

__all__ = ["flood_unauthenticated", "gate_token", "throw_garbage"]


def gate_token(source: Secret | Listener) -> tuple[bytes, bytes]:
    """A token that passes the gate of a listener holding ``source`` (its secret, or the
    listener itself): zmq PLAIN ``(username, password)``, as a dialer presents it in the
    clear, so what an observer of the network could capture."""
    from ._net.gate import dialer_token

    return dialer_token(source.key if isinstance(source, Secret) else source._key)


def throw_garbage(
    address: str, token: tuple[bytes, bytes], count: int = 10_000, *, seed: int = 13
) -> int:
    """Send ``count`` unsigned, truncated and random frames to the listener at ``address``
    (``tcp://host:port``) from 10 fresh connections that present ``token`` at the gate
    (:func:`gate_token`); return how many were sent. Each reaches the link's frame checks
    and is dropped there."""
    import zmq  # the network half of the channel

    rng = random.Random(seed)
    context = zmq.Context()
    sent = 0
    try:
        for batch in range(10):
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.PLAIN_USERNAME, token[0])
            sock.setsockopt(zmq.PLAIN_PASSWORD, token[1])
            # A token the gate refuses leaves every frame queued here: fail, do not hang.
            sock.setsockopt(zmq.SNDTIMEO, 10_000)
            sock.connect(address)
            for i in range(count // 10 + (batch < count % 10)):
                kind = (i + batch) % 4
                if kind == 0:
                    parts = [rng.randbytes(rng.randrange(0, 200))]
                elif kind == 1:  # a header-sized part, then what looks like a pickle
                    parts = [rng.randbytes(86), b"\x80\x05K\x01.", rng.randbytes(32)]
                elif kind == 2:
                    nparts = rng.randrange(1, 6)
                    parts = [rng.randbytes(rng.randrange(1, 64)) for _ in range(nparts)]
                else:  # an unsigned join request, as an agent would send it signed
                    parts = [b"J", json.dumps({"node_rank": 1}).encode()]
                try:
                    sock.send_multipart(parts)
                except zmq.Again:
                    raise RuntimeError(
                        f"the listener at {address} did not take frames for 10 s: was the "
                        "token made with its secret (gate_token)?"
                    ) from None
                sent += 1
            sock.close(linger=1000)
    finally:
        context.term()
    return sent


# ZMTP 3.0 greeting (RFC 23): signature, version 3.0, the mechanism padded to 20 bytes, the
# as-server flag, filler.
_GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"PLAIN".ljust(20, b"\0") + bytes(32)
_LONG, _MORE, _COMMAND = 0x02, 0x01, 0x04


def flood_unauthenticated(
    address: str,
    seconds: float,
    *,
    connections: int = 4,
    part_bytes: int = 256 << 20,
    garbage_connections: int = 200,
) -> dict[str, int]:
    """Attack the listener at ``address`` for ``seconds`` as a peer without the secret would,
    then return what was done (``bytes``, ``connections``).

    ``connections`` raw TCP connections each send a zmq greeting, then the parts of a
    multipart message that never ends, each declared ``part_bytes`` long, as fast as the
    listener reads (half of them as handshake commands, half as message parts), reconnecting
    whenever the listener cuts them; ``garbage_connections`` more connect at once, send a few
    random bytes each and hang up. Blocks until done; every socket is closed on return.
    """
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    host = host.strip("[]")
    deadline = time.monotonic() + seconds
    block = bytes(1 << 20)
    totals = {"bytes": 0, "connections": 0}
    lock = threading.Lock()

    def stream(index: int) -> None:
        flags = _LONG | (_COMMAND if index % 2 else _MORE)
        part_header = struct.pack("!BQ", flags, part_bytes)
        while time.monotonic() < deadline:
            sent = 0
            try:
                with socket.create_connection((host, int(port)), timeout=1.0) as conn:
                    conn.settimeout(max(0.05, deadline - time.monotonic()))
                    conn.sendall(_GREETING)
                    while time.monotonic() < deadline:
                        conn.sendall(part_header)
                        for _ in range(part_bytes // len(block)):
                            conn.sendall(block)
                            sent += len(block)
                            if time.monotonic() >= deadline:
                                break
            except OSError:
                time.sleep(0.01)  # cut by the listener (or timed out): dial again
            with lock:
                totals["bytes"] += sent
                totals["connections"] += 1

    def garbage(seed: int) -> None:
        rng = random.Random(seed)
        with lock:
            totals["connections"] += 1
        try:
            with socket.create_connection((host, int(port)), timeout=1.0) as conn:
                conn.sendall(rng.randbytes(rng.randrange(1, 512)))
        except OSError:
            pass

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(connections)]
    threads += [
        threading.Thread(target=garbage, args=(i,), daemon=True) for i in range(garbage_connections)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 5.0)
    return totals
