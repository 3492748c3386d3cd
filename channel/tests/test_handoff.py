"""The ring handoff: a node's ring descriptors reach processes that are not the driver's
children (over a Unix socket, SCM_RIGHTS), only those that prove the key, each index once."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from executor_channel import NodeRings, WorkerFds, _handoff_server
from executor_channel._handoff_client import HandoffError, HandoffTimeoutError, receive_fds
from executor_channel._handoff_server import RingHandoff
from executor_channel._node_rings import RingSizes
from executor_core import ExecutorError

WAIT = 10.0  # every wait in these tests is bounded by this
SIZES = RingSizes(slots=2, slot_bytes=4096, reply_slots=1, reply_slot_bytes=4096, spin_s=0)
WORKERS = 2

# A worker in another process: takes its descriptors, attaches, answers one call.
CHILD = """
import os, sys, time
from executor_channel._handoff_client import receive_fds
from executor_channel import SegmentLayout, WorkerRings

address, index = sys.argv[1], int(sys.argv[2])
fds = receive_fds(address, bytes.fromhex(os.environ["HANDOFF_TEST_KEY"]), index, 10.0)
layout = SegmentLayout.build(2, 2, 4096, 1, 4096)
rings = WorkerRings.attach(fds, layout, index, 0.0, 0.0)
call = rings.calls.read(bytes, deadline=time.monotonic() + 10)
assert call is not None, "no call came"
reply = b"worker %d (pid %d) got " % (index, os.getpid()) + call
assert rings.replies.write([reply], len(reply), deadline=time.monotonic() + 10)
"""


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture(autouse=True)
def no_fd_leaks() -> Iterator[None]:
    """Every test leaves this process's descriptors as it found them."""
    before = _open_fds()
    yield
    after = _open_fds()
    assert after == before, f"descriptors leaked: {sorted(after - before, key=int)}"


@pytest.fixture
def nodes() -> Iterator[NodeRings]:
    cleanups: list[Callable[[], None]] = []
    rings = NodeRings(WORKERS, SIZES, cleanups.append)
    yield rings
    for cleanup in reversed(cleanups):
        cleanup()


@pytest.fixture
def key() -> bytes:
    return secrets.token_bytes(32)


def _offers(nodes: NodeRings, indices: range | list[int] = range(WORKERS)) -> dict[int, WorkerFds]:
    return {index: nodes.worker_fds(index) for index in indices}


@contextmanager
def serving(handoff: RingHandoff, deadline_s: float = WAIT) -> Iterator[list[BaseException]]:
    """``handoff.serve`` in a thread; yields the list its error (if any) goes to, joins it on
    exit (aborting it through ``check`` if the body failed), and closes the handoff."""
    errors: list[BaseException] = []
    stop = threading.Event()

    def check() -> None:
        if stop.is_set():
            raise RuntimeError("the test failed")

    def run() -> None:
        try:
            handoff.serve(time.monotonic() + deadline_s, check)
        except BaseException as exc:  # noqa: BLE001 - for the test to assert on
            errors.append(exc)

    thread = threading.Thread(target=run, name="handoff-serve", daemon=True)
    thread.start()
    try:
        yield errors
    except BaseException:
        stop.set()
        raise
    finally:
        thread.join(WAIT + deadline_s)
        handoff.close()
    assert not thread.is_alive(), "serve did not return"


def _close(fds: WorkerFds) -> None:
    for fd in fds.as_tuple():
        os.close(fd)


def _assert_same_files(received: WorkerFds, offered: WorkerFds) -> None:
    """The received descriptors open the very files offered: the same shared-memory file,
    and eventfds that ring each other."""
    assert len(set(received.as_tuple()) | set(offered.as_tuple())) == 10  # new descriptors
    ours, theirs = os.fstat(received.segment), os.fstat(offered.segment)
    assert (ours.st_dev, ours.st_ino) == (theirs.st_dev, theirs.st_ino)
    for mine, original in zip(received.as_tuple()[1:], offered.as_tuple()[1:], strict=True):
        os.eventfd_write(mine, 1)
        assert select.select([original], [], [], 0)[0], "the received eventfd is another one"
        assert os.eventfd_read(original) == 1


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == "executor_channel" and record.levelno == logging.WARNING
    ]


def _connect(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(WAIT)
    sock.connect("\0" + address[1:])
    return sock


def _recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    data = b""
    while len(data) < nbytes:
        chunk = sock.recv(nbytes - len(data))
        assert chunk, "hung up"
        data += chunk
    return data


def _request(key: bytes, index: int, challenge: bytes) -> bytes:
    """A request as the protocol (module docstring) spells it, written out independently."""
    assert challenge[:8] == b"EXHOFF\x00\x01"
    server_nonce, client_nonce = challenge[8:], secrets.token_bytes(32)
    index_bytes = struct.pack("<Q", index)
    mac = hmac.new(
        key, b"executor-handoff" + server_nonce + client_nonce + index_bytes, hashlib.sha256
    ).digest()
    return client_nonce + index_bytes + mac


# --- across processes -------------------------------------------------------------------


def test_workers_in_other_processes_attach_and_answer(nodes: NodeRings, key: bytes) -> None:
    handoff = RingHandoff(key, _offers(nodes))
    assert handoff.address.startswith("@executor-handoff-")
    env = {**os.environ, "HANDOFF_TEST_KEY": key.hex()}
    children = []
    try:
        for index in range(WORKERS):
            children.append(
                subprocess.Popen(
                    [sys.executable, "-c", CHILD, handoff.address, str(index)],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
            )
        handoff.serve(time.monotonic() + WAIT)
        call = b"ping"
        assert nodes.calls.write([call], len(call), deadline=time.monotonic() + WAIT)
        replies = [ring.read(bytes, deadline=time.monotonic() + WAIT) for ring in nodes.replies]
        for index, child in enumerate(children):
            _, err = child.communicate(timeout=WAIT)
            assert child.returncode == 0, err.decode()
            assert replies[index] == b"worker %d (pid %d) got ping" % (index, child.pid)
    finally:
        handoff.close()
        for child in children:
            if child.poll() is None:
                child.kill()
            child.communicate()


# --- refusals ---------------------------------------------------------------------------


def test_a_wrong_key_gets_nothing_and_the_right_one_still_does(
    nodes: NodeRings, key: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "executor_channel")
    offers = _offers(nodes, [0])
    handoff = RingHandoff(key, offers)
    with serving(handoff) as errors:
        with pytest.raises(HandoffError, match="wrong key"):
            receive_fds(handoff.address, secrets.token_bytes(32), 0, WAIT)
        received = receive_fds(handoff.address, key, 0, WAIT)
    assert not errors
    try:
        _assert_same_files(received, offers[0])
    finally:
        _close(received)
    [warning] = _warnings(caplog)
    assert "wrong key" in warning


def test_unknown_and_taken_indices_are_refused(
    nodes: NodeRings, key: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "executor_channel")
    handoff = RingHandoff(key, _offers(nodes))
    with serving(handoff) as errors:
        first = receive_fds(handoff.address, key, 0, WAIT)
        with pytest.raises(HandoffError, match="already handed"):
            receive_fds(handoff.address, key, 0, WAIT)
        with pytest.raises(HandoffError, match="no descriptors for this worker index"):
            receive_fds(handoff.address, key, 7, WAIT)
        second = receive_fds(handoff.address, key, 1, WAIT)
    assert not errors
    _close(first)
    _close(second)
    assert len(_warnings(caplog)) == 2
    # Every index was taken: serve returned, and the socket is gone with close.
    with pytest.raises(HandoffError, match="nothing listens"):
        receive_fds(handoff.address, key, 1, WAIT)


def test_another_uid_is_hung_up_on(
    nodes: NodeRings, key: bytes, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, "executor_channel")
    uid = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: uid + 1)  # the server thinks it is someone else
    handoff = RingHandoff(key, _offers(nodes, [0]))
    monkeypatch.undo()
    with serving(handoff, deadline_s=0.5) as errors, pytest.raises(HandoffError, match="hung up"):
        receive_fds(handoff.address, key, 0, WAIT)
    [error] = errors
    assert isinstance(error, ExecutorError)
    [warning] = _warnings(caplog)
    assert f"uid {uid}" in warning


def test_a_server_without_the_key_cannot_feed_descriptors(key: bytes) -> None:
    address = "@executor-handoff-test-" + secrets.token_hex(8)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + address[1:])
    listener.listen()
    bell = os.eventfd(0)
    sent_fds: list[bool] = []

    def impostor() -> None:  # speaks the protocol but forges the proof
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(WAIT)
            conn.sendall(b"EXHOFF\x00\x01" + secrets.token_bytes(32))
            _recv_exact(conn, 72)
            conn.sendall(b"\x00" + secrets.token_bytes(32))
            try:  # descriptors pushed unasked: the worker must never install them
                socket.send_fds(conn, [b"\x00" * 8], [bell] * 5)
                sent_fds.append(True)
            except OSError:
                sent_fds.append(False)

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    try:
        with pytest.raises(HandoffError, match="did not prove"):
            receive_fds(address, key, 0, WAIT)
    finally:
        thread.join(WAIT)
        listener.close()
        os.close(bell)
    assert sent_fds  # the impostor got as far as pushing them


# --- time limits ------------------------------------------------------------------------


def test_the_deadline_names_the_indices_not_taken(key: bytes) -> None:
    cleanups: list[Callable[[], None]] = []
    nodes = NodeRings(3, SIZES, cleanups.append)
    handoff = RingHandoff(key, _offers(nodes, range(3)))
    checks: list[float] = []
    try:
        taker = threading.Thread(
            target=lambda: _close(receive_fds(handoff.address, key, 1, WAIT)), daemon=True
        )
        taker.start()
        start = time.monotonic()
        with pytest.raises(ExecutorError, match=r"\[0, 2\]"):
            handoff.serve(start + 1.2, lambda: checks.append(time.monotonic()))
        elapsed = time.monotonic() - start
        taker.join(WAIT)
    finally:
        handoff.close()
        for cleanup in reversed(cleanups):
            cleanup()
    assert 1.2 <= elapsed < 2.0
    gaps = [b - a for a, b in zip([start, *checks], [*checks, start + elapsed], strict=True)]
    assert max(gaps) <= 0.5 + 0.2, gaps  # check ran at least every 0.5 s


def test_check_aborts_serve(nodes: NodeRings, key: bytes) -> None:
    class Stop(Exception):
        pass

    calls = 0

    def check() -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise Stop

    handoff = RingHandoff(key, _offers(nodes))
    try:
        start = time.monotonic()
        with pytest.raises(Stop):
            handoff.serve(start + WAIT, check)
        assert time.monotonic() - start < 0.5 + 0.2
    finally:
        handoff.close()
    handoff.close()  # idempotent
    with pytest.raises(ExecutorError, match="closed"):
        handoff.serve(time.monotonic() + WAIT)


def test_a_stalled_peer_neither_blocks_others_nor_keeps_its_index(
    nodes: NodeRings, key: bytes, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, "executor_channel")
    monkeypatch.setattr(_handoff_server, "HANDSHAKE_TIMEOUT_S", 1.0)
    handoff = RingHandoff(key, _offers(nodes))
    with serving(handoff) as errors:
        silent = _connect(handoff.address)  # connects, never says a word
        # Authenticates for index 0, then stalls before asking for the descriptors.
        holder = _connect(handoff.address)
        holder.sendall(_request(key, 0, _recv_exact(holder, 40)))
        assert _recv_exact(holder, 33)[0] == 0  # accepted: index 0 is reserved for it
        start = time.monotonic()
        second = receive_fds(handoff.address, key, 1, WAIT)  # not held up by either
        assert time.monotonic() - start < 0.5
        with pytest.raises(HandoffError, match="already handed"):
            receive_fds(handoff.address, key, 0, WAIT)  # reserved for now
        # Both stalled peers are hung up on in time, and index 0 is offered again.
        assert len(_recv_exact(silent, 40)) == 40
        assert silent.recv(1) == b""
        assert holder.recv(1) == b""
        first = receive_fds(handoff.address, key, 0, WAIT)
        silent.close()
        holder.close()
    assert not errors
    _close(first)
    _close(second)
    stalls = [warning for warning in _warnings(caplog) if "within 1 s" in warning]
    assert len(stalls) == 2


def test_peers_beyond_the_pending_limit_wait_their_turn(
    nodes: NodeRings, key: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_handoff_server, "_MAX_PENDING", 1)
    monkeypatch.setattr(_handoff_server, "HANDSHAKE_TIMEOUT_S", 0.3)
    handoff = RingHandoff(key, _offers(nodes, [0]))
    with serving(handoff) as errors:
        silent = _connect(handoff.address)
        assert len(_recv_exact(silent, 40)) == 40  # it holds the one place
        start = time.monotonic()
        received = receive_fds(handoff.address, key, 0, WAIT)  # waits until it is dropped
        assert time.monotonic() - start >= 0.2
        silent.close()
    assert not errors
    _close(received)


def test_receive_fds_fails_clearly(key: bytes) -> None:
    with pytest.raises(HandoffError, match="nothing listens"):
        receive_fds("@executor-handoff-nobody-" + secrets.token_hex(8), key, 0, WAIT)
    with pytest.raises(ValueError, match="abstract socket name"):
        receive_fds("/tmp/some-path", key, 0, WAIT)
    with pytest.raises(ValueError, match="at least 16"):
        receive_fds("@x", b"short", 0, WAIT)
    with pytest.raises(ValueError, match="worker index"):
        receive_fds("@x", key, -1, WAIT)
    # A listener that never answers: the timeout holds.
    address = "@executor-handoff-mute-" + secrets.token_hex(8)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as mute:
        mute.bind("\0" + address[1:])
        mute.listen()
        start = time.monotonic()
        with pytest.raises(HandoffTimeoutError, match=r"within 0\.3 s"):
            receive_fds(address, key, 0, 0.3)
        assert time.monotonic() - start < 0.8
    # A full listen backlog (connect says EAGAIN at once): receive_fds waits, within its time.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as full:
        full.bind("\0" + address[1:])
        full.listen(0)
        with _connect(address):  # takes the one place in the backlog
            start = time.monotonic()
            with pytest.raises(HandoffTimeoutError):
                receive_fds(address, key, 0, 0.3)
            assert 0.3 <= time.monotonic() - start < 0.8


def test_the_server_checks_its_arguments(nodes: NodeRings, key: bytes) -> None:
    with pytest.raises(ValueError, match="at least 16"):
        RingHandoff(b"short", _offers(nodes))
    with pytest.raises(ValueError, match="worker index"):
        RingHandoff(key, {-1: nodes.worker_fds(0)})
    handoff = RingHandoff(key, {})  # nothing to hand over: serve returns at once
    try:
        handoff.serve(time.monotonic())
    finally:
        handoff.close()
    # close never touches the offered descriptors: they belong to the NodeRings.
    handoff = RingHandoff(key, _offers(nodes))
    handoff.close()
    for fd in nodes.worker_fds(0).as_tuple():
        os.fstat(fd)
