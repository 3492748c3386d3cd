"""Fuzz: at least 10,000 malformed and unsigned frames at the listener.

Nothing of them reaches the decode callback (which would unpickle), the listener's loop
keeps running, and authenticated calls still round-trip afterwards.
"""

from __future__ import annotations

import logging
import pickle
import random
import struct
import time
from collections.abc import Callable

import pytest
from channel_helpers import WAIT, Server, raw_dealers, wire_tap

from executor_channel import Connection, Listener, Secret
from executor_channel._net.frames import MAC_BYTES, VERSION, Direction, tag
from executor_channel._net.link import Message
from executor_channel.testing import gate_token

FRAMES = 10_000
DEALERS = 4
# The fixed header layout of executor_channel._net.frames (big-endian): magic, version, kind,
# padding, session, epoch, sequence, part count.
FIXED = struct.Struct("!4sBBxx16s16sQI")


def forge(
    rng: random.Random,
    *,
    version: int = VERSION,
    kind: int = 3,
    count: int | None = None,
    lengths: list[int] | None = None,
    parts: list[bytes] | None = None,
    key: bytes | None = None,
    session: bytes | None = None,
    epoch: bytes | None = None,
) -> list[bytes]:
    """A well-formed-looking frame: right magic, chosen fields, signed with ``key`` or junk."""
    parts = parts if parts is not None else [rng.randbytes(rng.randrange(0, 64))]
    lengths = lengths if lengths is not None else [len(p) for p in parts]
    session = session or rng.randbytes(16)
    epoch = epoch or rng.randbytes(16)
    sequence = rng.randrange(1, 1 << 64)
    header = FIXED.pack(
        b"EXCH", version, kind, session, epoch, sequence, len(lengths) if count is None else count
    ) + b"".join(struct.pack("!Q", n) for n in lengths)
    if key is None:
        mac = rng.randbytes(MAC_BYTES)
    else:
        views = [memoryview(p) for p in parts]
        total = len(header) + sum(len(p) for p in parts)
        mac = tag(key, Direction.TO_LISTENER, session, epoch, sequence, b"", header, views, total)
    return [header, *parts, mac]


def malformed_frames(rng: random.Random, valid: list[list[bytes]]) -> list[list[bytes]]:
    """FRAMES bad frames from a mix of generators, some derived from captured valid frames."""
    real_session = valid[1][0][24 - 16 : 24]  # the DATA frames' session id
    real_epoch = valid[1][0][24:40]
    wrong_key = Secret.generate().key

    def random_bytes() -> list[bytes]:
        return [rng.randbytes(rng.randrange(0, 200))]

    def random_parts() -> list[bytes]:
        return [rng.randbytes(rng.randrange(0, 80)) for _ in range(rng.randrange(1, 12))]

    def truncated() -> list[bytes]:
        frame = list(rng.choice(valid))
        if rng.random() < 0.5 and len(frame) > 1:
            del frame[rng.randrange(len(frame))]
        else:
            i = rng.randrange(len(frame))
            frame[i] = frame[i][: rng.randrange(len(frame[i]))] if frame[i] else b"x"
        return frame

    def bit_flipped() -> list[bytes]:
        frame = list(rng.choice(valid))
        i = rng.randrange(len(frame))
        if not frame[i]:
            frame[i] = b"\x01"
            return frame
        data = bytearray(frame[i])
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        frame[i] = bytes(data)
        return frame

    def garbled_mac() -> list[bytes]:
        frame = list(rng.choice(valid))
        frame[-1] = rng.randbytes(rng.choice([0, MAC_BYTES - 1, MAC_BYTES, MAC_BYTES + 1, 32]))
        return frame

    def replayed() -> list[bytes]:
        return list(rng.choice(valid))

    def huge_lengths() -> list[bytes]:
        return rng.choice(
            [
                lambda: forge(rng, lengths=[1 << 63]),
                lambda: forge(rng, lengths=[(1 << 64) - 1, 5]),
                lambda: forge(rng, count=(1 << 32) - 1),
                lambda: forge(rng, count=1 << 20, lengths=[]),
                lambda: forge(rng, lengths=[1 << 40], key=wrong_key),
            ]
        )()

    def odd_header() -> list[bytes]:
        return rng.choice(
            [
                lambda: forge(rng, version=rng.choice([0, VERSION - 1, 255])),
                lambda: forge(rng, kind=rng.choice([0, 5, 255])),
                lambda: forge(rng, kind=1),  # a HELLO with a random MAC
                lambda: forge(rng, kind=2),  # a WELCOME sent to a listener
                lambda: [FIXED.pack(b"EXCH", VERSION, 3, b"", b"", 1, 0)[: rng.randrange(52)]],
            ]
        )()

    def wrong_secret() -> list[bytes]:
        # Right structure, right session and epoch, signed with another secret.
        return forge(rng, key=wrong_key, session=real_session, epoch=real_epoch)

    def unsigned_call() -> list[bytes]:
        # What an attacker would most like delivered: a pickle, with no valid MAC.
        payload = pickle.dumps(("execute", "os.system", "echo pwned"))
        return forge(rng, parts=[payload], session=real_session, epoch=real_epoch)

    generators: list[Callable[[], list[bytes]]] = [
        random_bytes,
        random_parts,
        truncated,
        bit_flipped,
        garbled_mac,
        replayed,
        huge_lengths,
        odd_header,
        wrong_secret,
        unsigned_call,
    ]
    return [generators[i % len(generators)]() for i in range(FRAMES)]


def test_fuzz_listener(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="executor_channel")
    rng = random.Random(20250130)
    secret = Secret.generate()
    decoded: list[object] = []

    def decode(message: Message) -> list[bytes]:
        # What a backend does with a message: unpickle it. Only authentic ones may get here.
        decoded.append(pickle.loads(message.parts[0]))
        return [pickle.dumps(("ok", decoded[-1]))]

    with Listener(secret) as listener, Server(listener, decode) as server:
        with wire_tap(Connection) as captured:
            connection = Connection(listener.address, secret, timeout=WAIT)
            for i in range(20):
                connection.send([pickle.dumps(("call", i))], timeout=WAIT)
                assert pickle.loads(connection.recv(timeout=WAIT).parts[0]) == ("ok", ("call", i))
        assert len(captured) == 21  # the HELLO and the calls: all valid once, stale now
        frames = malformed_frames(rng, captured)
        start = time.monotonic()
        with raw_dealers(listener.address, DEALERS, gate_token(secret)) as dealers:
            for i, frame in enumerate(frames):
                dealers[i % DEALERS].send_multipart(frame)
            deadline = time.monotonic() + WAIT
            while sum(listener.drops.values()) < FRAMES:
                assert time.monotonic() < deadline, f"dropped only {listener.drops}"
                assert server.thread.is_alive()
                time.sleep(0.02)
        elapsed = time.monotonic() - start
        assert sum(listener.drops.values()) == FRAMES, listener.drops
        assert server.thread.is_alive()
        assert not server.errors
        assert decoded == [("call", i) for i in range(20)]  # the fuzz decoded nothing
        drops = listener.drops
        for reason in ("malformed", "bad_lengths", "too_large", "bad_mac", "replayed"):
            assert drops.get(reason, 0) > 0, (reason, drops)
        # One warning per peer: each raw dealer is a peer.
        warnings = [r for r in caplog.records if r.name == "executor_channel"]
        assert len(warnings) == DEALERS, [w.getMessage() for w in warnings]

        # Afterwards authenticated calls still round-trip, on the old and on a new session.
        with Connection(listener.address, secret, timeout=WAIT) as fresh:
            for link in (connection, fresh):
                for i in range(20, 40):
                    link.send([pickle.dumps(("call", i))], timeout=WAIT)
                    reply = pickle.loads(link.recv(timeout=WAIT).parts[0])
                    assert reply == ("ok", ("call", i))
        connection.close()
    assert not server.errors
    assert len(decoded) == 60
    # A loose bound that still catches a listener gone quadratic or sleeping per frame.
    assert elapsed < 20, f"{FRAMES} bad frames took {elapsed:.1f}s"
