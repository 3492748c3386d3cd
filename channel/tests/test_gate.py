"""The listener's gate and its bounds: what a peer without the secret can make it hold."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
from channel_helpers import WAIT, Server
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from executor_channel import Connection, DropReason, Limits, Listener, Secret
from executor_channel._net.frames import (
    VERSION,
    Direction,
    FrameError,
    Header,
    Kind,
    joined,
    parse_header,
    payload_chunks,
    read_frame,
    seal,
    verify,
)
from executor_channel._net.link import Message

KEY = bytes(range(32))


def payload_parts(frames: list[memoryview], header: Header) -> tuple[memoryview, ...]:
    """Each payload part whole, as ``Message.parts`` gives it."""
    return tuple(joined(pieces) for pieces in payload_chunks(frames, header))


SESSION = bytes(16)


def echo(message: Message) -> list[memoryview]:
    return list(message.parts)


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def frame(
    parts: list[bytes],
    chunk_bytes: int | None,
    *,
    key: bytes = KEY,
    direction: Direction = Direction.TO_LISTENER,
    epoch: bytes = SESSION,
    sequence: int = 1,
    salt: bytes = b"",
) -> list[memoryview]:
    frames = seal(
        key,
        direction,
        Kind.DATA,
        session=SESSION,
        epoch=epoch,
        sequence=sequence,
        parts=[memoryview(p) for p in parts],
        chunk_bytes=chunk_bytes,
        salt=salt,
    )
    # As a receiver cuts it: a small frame travels as one zmq part.
    return read_frame([memoryview(bytes(f)) for f in frames], Limits())[1]


def test_large_parts_travel_in_chunks_and_come_back_whole() -> None:
    parts = [b"a" * 2500, b"", b"b" * 1000, b"c" * 1001]
    frames = frame(parts, 1000)
    # header, 3 chunks, 1 empty, 1 whole, 2 chunks, mac
    assert [f.nbytes for f in frames[1:-1]] == [1000, 1000, 500, 0, 1000, 1000, 1]
    header = parse_header(frames, Limits())
    assert header.lengths == (2500, 0, 1000, 1001)
    assert header.spans == (3, 1, 1, 2)
    assert [bytes(p) for p in payload_parts(frames, header)] == parts
    # A part that came whole is not copied.
    assert payload_parts(frames, header)[2].obj is frames[5].obj


@pytest.mark.parametrize(
    "cut",
    [
        lambda fs: fs[:3] + fs[4:],  # a chunk missing
        lambda fs: [*fs[:3], memoryview(b"x"), *fs[3:]],  # a chunk too many
        lambda fs: [*fs[:2], memoryview(b""), *fs[2:]],  # an empty chunk inside a part
        lambda fs: [*fs[:3], memoryview(bytes(fs[3]) + b"b"), *fs[4:]],  # a chunk too long
    ],
)
def test_chunks_that_do_not_add_up_are_dropped(
    cut: Callable[[list[memoryview]], list[memoryview]],
) -> None:
    frames = cut(frame([b"a" * 2500, b"b" * 10], 1000))
    with pytest.raises(FrameError) as raised:
        parse_header(frames, Limits())
    assert raised.value.reason is DropReason.BAD_LENGTHS


def test_chunks_cut_elsewhere_still_add_up() -> None:
    # The split carries no meaning: the lengths are in the header, and the MAC binds every
    # byte in order.
    frames = frame([b"a" * 2500], 1000)
    recut = [frames[0], memoryview(b"a" * 2000), memoryview(b"a" * 500), frames[-1]]
    header = parse_header(recut, Limits())
    assert [bytes(p) for p in payload_parts(recut, header)] == [b"a" * 2500]


def test_a_message_larger_than_a_chunk_round_trips(secret: Secret) -> None:
    limits = Limits(chunk_bytes=64 << 10)
    big = os.urandom(1 << 20) + b"tail"
    with (
        Listener(secret, limits=limits) as listener,
        Server(listener, echo) as server,
        Connection(listener.address, secret, timeout=WAIT, limits=limits) as connection,
    ):
        connection.send([big, b"", b"small"], timeout=WAIT)
        reply = connection.recv(timeout=WAIT)
        # As it arrived: the large part in chunks, the others whole; joined on first use.
        assert [len(pieces) for pieces in reply.chunks] == [17, 1, 1]
        assert {piece.nbytes for piece in reply.chunks[0][:-1]} == {64 << 10}
        assert b"".join(reply.chunks[0]) == big
        assert [bytes(p) for p in reply.parts] == [big, b"", b"small"]
        assert reply.parts is reply.parts  # joined once
        assert reply.parts[2].obj is reply.chunks[2][0].obj  # a whole part is not copied
    assert not server.errors
    assert listener.drops == {}


@pytest.mark.parametrize("payload_bytes", [0, 40, 64 << 10, (64 << 10) + 1, 3 << 20])
def test_the_mac_is_gmac_under_the_sessions_key(payload_bytes: int) -> None:
    # What docs/security.md states: AES-256-GCM over an empty plaintext, the header and the
    # parts as associated data, the sequence as the nonce, under HMAC-SHA256(secret, label,
    # direction, session, epoch, salt). Small frames and large ones (fed part by part, in
    # chunks) must give that same tag.
    key = os.urandom(32)
    epoch = os.urandom(16)
    salt = os.urandom(16)  # the listener's nonce for the session, toward the dialer
    parts = [os.urandom(payload_bytes), b"", b"b" * 10]
    received = frame(
        parts, 1 << 20, key=key, direction=Direction.TO_DIALER, epoch=epoch, sequence=7, salt=salt
    )
    label = b"executor-channel/3 frame key\x00" + Direction.TO_DIALER.value + SESSION + epoch
    derived = hmac.new(key, label + salt, hashlib.sha256).digest()
    nonce = bytes(4) + (7).to_bytes(8, "big")
    expected = AESGCM(derived).encrypt(nonce, b"", bytes(received[0]) + b"".join(parts))
    assert bytes(received[-1]) == expected
    assert verify(key, Direction.TO_DIALER, received, salt)
    assert not verify(key, Direction.TO_DIALER, received)  # another session's key
    assert not verify(key, Direction.TO_LISTENER, received, salt)  # the direction is in the key
    assert not verify(os.urandom(32), Direction.TO_DIALER, received, salt)
    flipped = bytearray(received[-2])
    flipped[-1] ^= 1
    tampered = [*received[:-2], memoryview(flipped), received[-1]]
    assert not verify(key, Direction.TO_DIALER, tampered, salt)


@pytest.fixture
def secret() -> Secret:
    return Secret.generate()


def _raw_connections(port: int, count: int) -> list[socket.socket]:
    conns = []
    for _ in range(count):
        conn = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
        conns.append(conn)
    return conns


def _closed_by_peer(conn: socket.socket, within: float) -> bool:
    conn.settimeout(within)
    try:
        while True:
            if not conn.recv(4096):  # zmq's greeting first, then EOF
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_connections_beyond_max_pending_are_cut(secret: Secret) -> None:
    limits = Limits(max_pending=4, handshake_s=WAIT)
    with Listener(secret, limits=limits) as listener, Server(listener, echo) as server:
        conns = _raw_connections(listener.port, 12)  # silent: they never finish the handshake
        try:
            deadline = time.monotonic() + WAIT
            while listener.drops.get(DropReason.PENDING.value, 0) < 8:
                assert time.monotonic() < deadline, listener.drops
                time.sleep(0.02)
            closed = [_closed_by_peer(conn, 0.5) for conn in conns]
            assert closed.count(True) == 8
            assert closed[:4] == [False] * 4  # the first four are kept, the newest cut
            # Like a full accept queue: while the slots are held, newcomers are cut; sessions
            # already open are never touched. Once the slots free, a dialer gets in.
            for conn in conns[:4]:
                conn.close()
            with Connection(listener.address, secret, timeout=WAIT) as connection:
                connection.send([b"in"], timeout=WAIT)
                assert bytes(connection.recv(timeout=WAIT).parts[0]) == b"in"
        finally:
            for conn in conns:
                conn.close()
    assert not server.errors


def test_the_handshake_has_a_deadline(secret: Secret) -> None:
    with Listener(secret, limits=Limits(handshake_s=0.5)) as listener, Server(listener, echo):
        (conn,) = _raw_connections(listener.port, 1)
        with conn:
            start = time.monotonic()
            assert _closed_by_peer(conn, WAIT)
            assert 0.3 < time.monotonic() - start < 3.0


# What one connection that has not passed the gate can make a listener hold is one zmq part
# (chunk_bytes); the bound for the flood below adds zmq's own buffers and allocator slack.
RSS_BOUND = 32 << 20


@pytest.mark.slow
def test_unfinished_messages_and_garbage_hold_bounded_memory(secret: Secret) -> None:
    """Several connections stream 256 MiB parts of messages they never finish, and 200 more
    send garbage, while an authenticated client keeps calling: the listener's process grows
    by at most RSS_BOUND, every call is answered, and every flooding connection is refused."""
    seconds = 6.0
    with Listener(secret) as listener, Server(listener, echo) as server:  # noqa: SIM117 (the connection must close before the listener's drops are read)
        with Connection(listener.address, secret, timeout=WAIT) as connection:
            connection.send([b"warm"], timeout=WAIT)
            connection.recv(timeout=WAIT)
            baseline = rss_bytes()
            peak = baseline
            attacker = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "import sys, json; from executor_channel.testing import "
                    "flood_unauthenticated as f; "
                    f"print(json.dumps(f(sys.argv[1], {seconds}, connections=6)))",
                    listener.address,
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            calls = 0
            try:
                while attacker.poll() is None:
                    connection.send([b"call %d" % calls], timeout=WAIT)
                    assert bytes(connection.recv(timeout=WAIT).parts[0]) == b"call %d" % calls
                    calls += 1
                    peak = max(peak, rss_bytes())
                    time.sleep(0.005)
                out, _ = attacker.communicate(timeout=WAIT)
            finally:
                if attacker.poll() is None:
                    attacker.kill()
                    attacker.wait(WAIT)
    done = json.loads(out)
    assert done["bytes"] > 64 << 20, done  # the attack really sent data
    assert calls > 50
    assert peak - baseline < RSS_BOUND, (peak - baseline) >> 20
    # Each streaming connection was cut (a part above chunk_bytes) and dialled again.
    assert done["connections"] > 200 + 6 * 3, done
    assert listener.drops == {}  # nothing reached the link: zmq refused it all
    assert not server.errors


def test_one_gate_per_context(secret: Secret) -> None:
    import zmq

    from executor_channel import ChannelError

    context: zmq.Context[object] = zmq.Context()
    try:
        with Listener(secret, context=context), pytest.raises(ChannelError, match="own context"):
            Listener(secret, context=context)
    finally:
        context.term()


def test_the_gate_leaves_no_thread_behind(secret: Secret) -> None:
    before = threading.active_count()
    with (
        Listener(secret) as listener,
        Server(listener, echo),
        Connection(listener.address, secret, timeout=WAIT) as connection,
    ):
        connection.send([b"x"], timeout=WAIT)
        connection.recv(timeout=WAIT)
    assert threading.active_count() == before


def test_a_compact_frame_is_cut_by_its_header_before_its_mac() -> None:
    # A frame of at most 64 KiB travels as one zmq part: header, parts and MAC back to back.
    # The receiver cuts it by the sizes its header declares, and refuses one whose sizes do
    # not add up before any MAC work; the MAC is the one the same frame in parts carries.
    parts = [b"a" * 10, b"", b"b" * 30]
    (compact,) = seal(
        KEY,
        Direction.TO_LISTENER,
        Kind.DATA,
        session=SESSION,
        epoch=SESSION,
        sequence=1,
        parts=[memoryview(p) for p in parts],
        chunk_bytes=1 << 20,
    )
    whole = bytes(compact)
    views = read_frame([memoryview(whole)], Limits())[1]
    assert [bytes(view) for view in views[1:-1]] == parts
    assert verify(KEY, Direction.TO_LISTENER, views)
    assert bytes(views[-1]) == bytes(frame(parts, None)[-1])  # as in parts
    for bad, reason in [
        (whole[:-1], DropReason.BAD_LENGTHS),
        (whole + b"x", DropReason.BAD_LENGTHS),
        (whole[:20], DropReason.MALFORMED),
    ]:
        with pytest.raises(FrameError) as raised:
            read_frame([memoryview(bad)], Limits())[1]
        assert raised.value.reason is reason
    # The checks of a frame in parts hold for the compact frame too, in the same pass.
    header, _ = read_frame([memoryview(whole)], Limits())
    assert header == parse_header(frame(parts, 10), Limits())._replace(spans=(1, 1, 1))
    for limits in [Limits(max_parts=2), Limits(max_part_bytes=29)]:
        with pytest.raises(FrameError) as raised:
            read_frame([memoryview(whole)], limits)
        assert raised.value.reason is DropReason.TOO_LARGE
    for at, value, reason in [
        (0, ord("X"), DropReason.MALFORMED),  # not our magic
        (4, VERSION + 1, DropReason.UNKNOWN_VERSION),
        (5, 99, DropReason.UNKNOWN_KIND),
    ]:
        altered = bytearray(whole)
        altered[at] = value
        with pytest.raises(FrameError) as raised:
            read_frame([memoryview(altered)], Limits())
        assert raised.value.reason is reason
    several = frame([b"a" * 2500], 1000)  # larger than a chunk: in parts
    assert read_frame(several, Limits())[1] is several  # checked, and kept as it came
