"""Helpers for the tests of backends built on the channel.

:func:`throw_garbage` sends a listener frames that no holder of the secret made (random
bytes, truncated and pickle-looking parts, forged join requests) from several fresh
connections: a backend's test runs it against its driver's listener while calls go on, and
checks that every call still succeeds and nothing was unpickled.
"""

from __future__ import annotations

import json
import random

__all__ = ["throw_garbage"]


def throw_garbage(address: str, count: int = 10_000, *, seed: int = 13) -> int:
    """Send ``count`` unsigned, truncated and random frames to the listener at ``address``
    (``tcp://host:port``) from 10 fresh connections; return how many were sent."""
    import zmq  # the network half of the channel

    rng = random.Random(seed)
    context = zmq.Context()
    sent = 0
    try:
        for batch in range(10):
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
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
                sock.send_multipart(parts)
                sent += 1
            sock.close(linger=1000)
    finally:
        context.term()
    return sent
