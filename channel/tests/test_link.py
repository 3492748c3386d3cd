"""Listener and Connection: round trips, timeouts, wrong secrets, replays, warnings, closing."""

from __future__ import annotations

import logging
import pickle
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from channel_helpers import WAIT, Server, raw_dealers, wire_tap

from executor_channel import (
    ChannelError,
    ChannelTimeoutError,
    Connection,
    DropReason,
    Limits,
    Listener,
    Secret,
)
from executor_channel._net.frames import MAC_BYTES, Direction, read_frame, verify
from executor_channel._net.link import Message, PeerId
from executor_channel._net.listener import LOOPBACK
from executor_channel.testing import gate_token

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def secret() -> Secret:
    return Secret.generate()


@pytest.fixture
def listener(secret: Secret) -> Iterator[Listener]:
    with Listener(secret) as listener:
        yield listener


def echo(message: Message) -> list[bytes | memoryview]:
    return [b"echo", *message.parts]


def wait_for(condition: Callable[[], object]) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def channel_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r for r in caplog.records if r.name == "executor_channel" and r.levelno >= logging.WARNING
    ]


def test_binds_loopback_on_an_os_chosen_port(listener: Listener) -> None:
    assert listener.address == f"tcp://{LOOPBACK}:{listener.port}"
    assert listener.port > 0


def test_explicit_host_and_port(secret: Secret) -> None:
    with Listener(secret, host="127.0.0.1") as first:
        port = first.port
    with Listener(secret, host="127.0.0.1", port=port) as listener, Server(listener, echo):
        assert listener.port == port
        with Connection(listener.address, secret, timeout=WAIT) as connection:
            connection.send([b"x"], timeout=WAIT)
            assert [bytes(p) for p in connection.recv(timeout=WAIT).parts] == [b"echo", b"x"]


def test_bind_failure_is_clear(secret: Secret, listener: Listener) -> None:
    with pytest.raises(ChannelError, match="cannot listen on"):
        Listener(secret, port=listener.port)


def test_round_trip_many_messages(secret: Secret, listener: Listener) -> None:
    count = 500
    with (
        Server(listener, echo) as server,
        Connection(listener.address, secret, timeout=WAIT) as connection,
    ):
        for i in range(count):
            connection.send([b"%d" % i, b"x" * (i % 7)], timeout=WAIT)
        for i in range(count):
            message = connection.recv(timeout=WAIT)
            assert [bytes(p) for p in message.parts] == [b"echo", b"%d" % i, b"x" * (i % 7)]
            assert message.peer == connection.peer
    assert not server.errors
    assert listener.drops == {}
    assert connection.drops == {}


def test_both_ways_from_one_thread_once_open(secret: Secret, listener: Listener) -> None:
    peers: list[PeerId] = []
    with Server(listener, lambda m: peers.append(m.peer)):
        connection = Connection(listener.address, secret, timeout=WAIT)
        connection.send([b"hello"], timeout=WAIT)
        wait_for(lambda: peers)
    try:
        # The server thread has stopped: the listener belongs to this thread again.
        assert listener.peers == (peers[0],)
        for i in range(200):
            listener.send(peers[0], [b"down %d" % i], timeout=WAIT)
            connection.send([b"up %d" % i], timeout=WAIT)
        for i in range(200):
            assert bytes(connection.recv(timeout=WAIT).parts[0]) == b"down %d" % i
            message = listener.recv(timeout=WAIT)
            assert (message.peer, bytes(message.parts[0])) == (peers[0], b"up %d" % i)
    finally:
        connection.close()
    # The connection's BYE closes its session at the listener.
    with pytest.raises(ChannelTimeoutError):
        listener.recv(timeout=0.3)
    assert listener.peers == ()
    with pytest.raises(ChannelError, match="no open session"):
        listener.send(peers[0], [b"late"], timeout=WAIT)


def test_large_multipart_message_with_out_of_band_buffers(secret: Secret) -> None:
    blob = bytearray(b"a" * (24 << 20))
    tail = b"z" * (8 << 20)

    def decode_and_echo(message: Message) -> list[bytes | memoryview]:
        # Test code decoding authenticated parts, as a backend will.
        value = pickle.loads(message.parts[0], buffers=message.parts[1:-1])
        assert value["blob"] == blob
        assert message.parts[-1] == tail
        return list(message.parts)

    payload = {"blob": pickle.PickleBuffer(blob), "small": list(range(10)), "more": b"b" * 5000}
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(payload, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1, "the test means to send an out-of-band buffer"
    with (
        Listener(secret) as listener,
        Server(listener, decode_and_echo) as server,
        Connection(listener.address, secret, timeout=WAIT) as connection,
    ):
        connection.send([head, *buffers, tail], timeout=WAIT)
        reply = connection.recv(timeout=WAIT)
        assert len(reply.parts) == 3
        value = pickle.loads(reply.parts[0], buffers=reply.parts[1:-1])
        assert value["blob"] == blob
        assert value["small"] == list(range(10))
        assert value["more"] == b"b" * 5000
        assert reply.parts[-1] == tail
    assert not server.errors


def test_recv_timeouts_are_clear(secret: Secret, listener: Listener) -> None:
    start = time.monotonic()
    with pytest.raises(ChannelTimeoutError, match=r"no message within 0\.05s"):
        listener.recv(timeout=0.05)
    assert time.monotonic() - start < WAIT
    with pytest.raises(TimeoutError):  # a ChannelTimeoutError is a TimeoutError
        listener.recv(timeout=0)
    with pytest.raises(ValueError, match="timeout"):
        listener.recv(timeout=float("nan"))
    with pytest.raises(ValueError, match="timeout"):
        listener.recv(timeout=-1)
    with (
        Server(listener, echo),
        Connection(listener.address, secret, timeout=WAIT) as connection,
        pytest.raises(ChannelTimeoutError),
    ):
        connection.recv(timeout=0.05)


def test_recv_now_reads_what_waits_and_never_waits(secret: Secret, listener: Listener) -> None:
    start = time.monotonic()
    assert listener.recv_now() is None
    assert time.monotonic() - start < 0.5  # no wait, and no ChannelTimeoutError
    box: dict[str, Connection] = {}
    dialer = threading.Thread(
        target=lambda: box.setdefault("c", Connection(listener.address, secret, timeout=WAIT))
    )
    dialer.start()
    deadline = time.monotonic() + WAIT
    while dialer.is_alive():  # recv_now answers the handshake, and returns nothing for it
        assert time.monotonic() < deadline, "the handshake did not complete"
        listener.wait(0.05)
        assert listener.recv_now() is None
    with (
        box["c"] as connection,
        raw_dealers(listener.address, 1, gate_token(secret)) as (stranger,),
    ):
        for i in range(3):
            connection.send([b"call %d" % i], timeout=WAIT)
        got: list[Message] = []
        while len(got) < 3:
            assert listener.wait(WAIT)[0], "the calls did not arrive"
            while (message := listener.recv_now()) is not None:
                got.append(message)
        assert [bytes(m.parts[0]) for m in got] == [b"call %d" % i for i in range(3)]
        # A frame that fails the checks is dropped: recv_now reads past it to None.
        stranger.send_multipart([b"not a frame"])
        wait_for(lambda: listener.wait(0.05)[0] or sum(listener.drops.values()))
        wait_for(lambda: listener.recv_now() is None and sum(listener.drops.values()) == 1)
        # And the dialer's end.
        assert connection.recv_now() is None
        for i in range(2):
            listener.send(got[0].peer, [b"reply %d" % i], timeout=WAIT)
        replies: list[Message] = []
        while len(replies) < 2:
            assert connection.wait(WAIT)[0], "the replies did not arrive"
            while (message := connection.recv_now()) is not None:
                replies.append(message)
        assert [bytes(m.parts[0]) for m in replies] == [b"reply 0", b"reply 1"]
    with pytest.raises(ChannelError, match="closed"):
        connection.recv_now()


def test_handshake_timeout_when_nobody_listens(secret: Secret) -> None:
    with Listener(secret) as gone:
        address = gone.address
    with pytest.raises(ChannelTimeoutError, match="same secret"):
        Connection(address, secret, timeout=0.2)


def test_wrong_secret_is_ignored_right_one_served(
    secret: Secret, listener: Listener, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="executor_channel")
    intruder = Secret.generate()
    with Server(listener, echo) as server:
        with pytest.raises(ChannelTimeoutError, match=intruder.fingerprint):
            Connection(listener.address, intruder, timeout=0.3)
        with Connection(listener.address, secret, timeout=WAIT) as connection:
            connection.send([b"ok"], timeout=WAIT)
            assert bytes(connection.recv(timeout=WAIT).parts[1]) == b"ok"
    assert not server.errors
    # Refused in zmq's handshake: its gate token is not made with the listener's secret.
    assert set(listener.drops) == {DropReason.GATE.value}
    (warning,) = channel_warnings(caplog)
    assert "(gate)" in warning.getMessage()
    assert secret.fingerprint in warning.getMessage()


def test_replayed_frames_are_dropped(secret: Secret, listener: Listener) -> None:
    delivered: list[bytes] = []

    def record(message: Message) -> None:
        delivered.append(bytes(message.parts[0]))

    with (
        Server(listener, record) as server,
        raw_dealers(listener.address, 1, gate_token(secret)) as (attacker,),
        wire_tap(Connection) as captured,
    ):
        connection = Connection(listener.address, secret, timeout=WAIT)
        for i in range(5):
            connection.send([b"call %d" % i], timeout=WAIT)
        wait_for(lambda: len(delivered) == 5)
        assert len(captured) == 6  # HELLO and five calls
        for frames in captured:  # while the session is open
            attacker.send_multipart(frames)
        wait_for(lambda: listener.drops.get("replayed", 0) == 6)
        connection.close()  # BYE: the session is gone
        wait_for(lambda: not listener.peers)
        for frames in captured[1:]:  # the calls and the BYE
            attacker.send_multipart(frames)
        wait_for(lambda: listener.drops.get("unknown_session", 0) == 6)
    assert delivered == [b"call %d" % i for i in range(5)]
    assert not server.errors


def test_a_replayed_hello_gets_a_session_with_keys_of_its_own(secret: Secret) -> None:
    # A HELLO replayed once its session has ended opens a new session with the same ids in
    # the header, each time. Its frames toward the dialer (the WELCOME first, sequence 1
    # each time) must be under another key: a GMAC key must never tag two messages with one
    # nonce. (One session at most, so that a new dialer evicts the replayer's.)
    with (
        Listener(secret, limits=Limits(max_peers=1)) as listener,
        Server(listener, lambda message: None) as server,
        raw_dealers(listener.address, 1, gate_token(secret)) as (attacker,),
        wire_tap(Connection) as sent,
    ):
        Connection(listener.address, secret, timeout=WAIT).close()
        hello = sent[0]
        welcomes = []
        for _ in range(2):
            wait_for(lambda: not listener.peers)
            attacker.send_multipart(hello)
            received = [memoryview(part) for part in attacker.recv_multipart()]
            welcomes.append(read_frame(received, Limits())[1])  # a small frame: one part
            Connection(listener.address, secret, timeout=WAIT).close()  # evicts it
    first, second = welcomes
    assert bytes(first[0]) == bytes(second[0])  # the same header, sequence 1
    assert bytes(first[1]) != bytes(second[1])  # a new nonce for each session
    for frames in welcomes:  # each under the key of its own session
        assert verify(secret.key, Direction.TO_DIALER, frames, bytes(frames[1]))
    assert not verify(secret.key, Direction.TO_DIALER, second, bytes(first[1]))
    assert not server.errors


def test_frames_from_a_previous_listener_lifetime_are_dropped(secret: Secret) -> None:
    delivered: list[Message] = []
    with (
        Listener(secret) as old,
        Server(old, delivered.append),
        wire_tap(Connection) as captured,
    ):
        connection = Connection(old.address, secret, timeout=WAIT)
        connection.send([b"old call"], timeout=WAIT)
        wait_for(lambda: delivered)
    connection.close()
    delivered.clear()
    hello, call = captured
    # A new listener, same secret (same port or not: nothing in a frame names the port).
    with Listener(secret) as new, Server(new, delivered.append) as server:
        with raw_dealers(new.address, 1, gate_token(secret)) as (attacker,):
            attacker.send_multipart(call)
            wait_for(lambda: new.drops.get("unknown_session", 0) == 1)
            # A replayed HELLO opens a session no one can use: the old call binds the nonce
            # the old listener issued, not the one the new listener issued.
            attacker.send_multipart(hello)
            assert attacker.poll(int(WAIT * 1000))  # a WELCOME the replayer cannot use
            attacker.recv_multipart()
            attacker.send_multipart(call)
            wait_for(lambda: new.drops.get("wrong_epoch", 0) == 1)
        assert delivered == []
        assert not server.errors


def test_one_warning_per_peer(
    secret: Secret, listener: Listener, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="executor_channel")
    with (
        Server(listener, echo) as server,
        raw_dealers(listener.address, 2, gate_token(secret)) as dealers,
    ):
        for dealer in dealers:
            for i in range(30):
                dealer.send_multipart([b"junk %d" % i, b"more"])
        wait_for(lambda: sum(listener.drops.values()) == 60)
    assert not server.errors
    warnings = channel_warnings(caplog)
    assert len(warnings) == 2
    peers = {re.search(r"from peer (\w+)", w.getMessage()).group(1) for w in warnings}  # type: ignore[union-attr]
    assert len(peers) == 2
    assert listener.drops == {"malformed": 60}


def test_dialer_drops_bad_frames_from_a_fake_listener(
    secret: Secret, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="executor_channel")
    context: zmq.Context[Any] = zmq.Context()
    fake = context.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    fake.setsockopt(zmq.PLAIN_SERVER, 1)
    zap = context.socket(zmq.REP)  # a gate that takes any token
    zap.setsockopt(zmq.LINGER, 0)
    zap.bind("inproc://zeromq.zap.01")
    port = fake.bind_to_random_port(f"tcp://{LOOPBACK}")
    stop = threading.Event()

    def answer_with_junk() -> None:
        while not stop.is_set():
            if zap.poll(0):
                request = zap.recv_multipart()
                zap.send_multipart([b"1.0", request[1], b"200", b"OK", b"", b""])
            if fake.poll(50):
                routing_id, *received = fake.recv_multipart()
                fake.send_multipart([routing_id, b"junk"])
                fake.send_multipart([routing_id, *received])  # its own HELLO, reflected
                views = read_frame([memoryview(part) for part in received], Limits())[1]
                frames = [bytes(view) for view in views]
                forged = bytearray(frames[0])
                forged[5] = 2  # a WELCOME to the dialer's nonce, unsigned
                forged[24:40] = frames[1]
                fake.send_multipart([routing_id, bytes(forged), frames[1], bytes(MAC_BYTES)])

    thread = threading.Thread(target=answer_with_junk)
    thread.start()
    try:
        with pytest.raises(ChannelTimeoutError):
            Connection(f"tcp://{LOOPBACK}:{port}", secret, timeout=0.5)
    finally:
        stop.set()
        thread.join(WAIT)
        fake.close()
        zap.close()
        context.term()
    (warning,) = channel_warnings(caplog)
    assert f"connection to tcp://{LOOPBACK}:{port}" in warning.getMessage()
    reasons = [r.getMessage() for r in caplog.records if r.name == "executor_channel"]
    assert any("(malformed)" in m for m in reasons)  # the junk
    assert any("(unexpected)" in m for m in reasons)  # its own HELLO, reflected
    assert any("(bad_mac)" in m for m in reasons)  # the unsigned WELCOME


def test_send_timeout_when_the_queue_is_full(secret: Secret) -> None:
    with Listener(secret) as listener, Server(listener, echo):
        connection = Connection(listener.address, secret, timeout=WAIT, limits=Limits(hwm=1))

    def fill() -> None:
        for _ in range(100):
            connection.send([b"x" * 1000], timeout=0.01)

    try:
        # The listener is gone: messages queue in the connection until the high-water mark.
        with pytest.raises(ChannelTimeoutError, match="queued"):
            fill()
    finally:
        connection.close()


def test_bad_arguments(secret: Secret, listener: Listener) -> None:
    with pytest.raises(ValueError, match="tcp://"):
        Connection("127.0.0.1:5555", secret)
    with pytest.raises(TypeError, match="Secret"):
        Listener(b"k" * 32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_parts"):
        Limits(max_parts=0)
    with (
        Server(listener, echo),
        Connection(listener.address, secret, timeout=WAIT) as connection,
        pytest.raises(TypeError, match="wrap a single buffer"),
    ):
        connection.send(b"bytes, not a list of parts", timeout=WAIT)


def test_close_is_idempotent_and_leaves_nothing(secret: Secret) -> None:
    threads_before = set(threading.enumerate())
    context: zmq.Context[Any] = zmq.Context()
    try:
        listener = Listener(secret)
        shared_listener = Listener(secret, context=context)
        with Server(listener, echo):
            connection = Connection(listener.address, secret, timeout=WAIT)
            connection.send([b"x"], timeout=WAIT)
            connection.recv(timeout=WAIT)
        links = (listener, shared_listener, connection)
        for link in links:
            link.close()
            link.close()
            assert link.closed
            assert link._socket.closed
        assert listener._context.closed
        assert connection._context.closed
        assert not context.closed  # a context passed in belongs to the caller
        with pytest.raises(ChannelError, match="closed"):
            connection.send([b"x"], timeout=WAIT)
        with pytest.raises(ChannelError, match="closed"):
            listener.recv(timeout=0)
    finally:
        context.term()
    assert set(threading.enumerate()) == threads_before


def test_readme_example_runs(tmp_path: Path) -> None:
    readme = (ROOT / "channel" / "README.md").read_text()
    match = re.search(r"```python\n(.*?)```", readme, re.DOTALL)
    assert match, "channel/README.md lost its example"
    script = tmp_path / "example.py"
    script.write_text(match.group(1))
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "b'echo: hello'\n"
