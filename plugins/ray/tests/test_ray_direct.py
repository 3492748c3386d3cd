"""Direct calls: the executor's own authenticated sockets to the workers on its node."""

from __future__ import annotations

import os
import pickle
import socket
import struct
import time
from collections.abc import Iterator
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Listener
from typing import Any

import pytest
import ray

from executor_core import ExecutorClosedError, create_executor
from executor_core.testing import conformance_config
from executor_plugin_ray import _direct
from executor_plugin_ray._direct import DirectChannels, DirectServer
from executor_plugin_ray._encoding import Failed, pack
from executor_plugin_ray._executor import RayExecutor

BIG = 200 * 1024  # large enough to go as a Ray actor call (lifted into the object store)


def read(channels: DirectChannels, rank: int = 0) -> tuple[int, Any]:
    """The next reply from ``rank``: its call's number and the reply."""
    assert channels.wait(10) == [rank]
    return channels.recv(rank)


@pytest.mark.parametrize("host", [None, "127.0.0.1"], ids=["unix", "tcp"])
def test_the_channel_refuses_a_wrong_key_and_serves_the_right_one(host: str | None) -> None:
    seen: list[Any] = []

    def handle(call: bytes) -> Any:
        seen.append(pickle.loads(call))
        return pack(("result", len(seen)))

    key = os.urandom(32)
    server = DirectServer(key, handle, host)
    assert isinstance(server.address, str if host is None else tuple)
    family = "AF_UNIX" if host is None else "AF_INET"
    with pytest.raises(AuthenticationError):
        Client(server.address, family=family, authkey=os.urandom(32))
    assert seen == []  # nothing from the refused peer was read, let alone unpickled
    channels = DirectChannels([server.address], key, timeout_s=10)
    try:
        channels.send(1, pickle.dumps(["get_rank", [], None, None, []]))
        assert read(channels) == (1, ("result", 1))
        assert seen == [["get_rank", [], None, None, []]]
    finally:
        channels.close()


def test_replies_of_every_kind_cross_the_channel() -> None:
    failure = Failed(failure=None)  # type: ignore[arg-type]  # only its identity matters here
    replies = iter([pack(b"\x80\x05raw"), None, failure])
    server = DirectServer(b"k" * 32, lambda call: next(replies))
    channels = DirectChannels([server.address], b"k" * 32, timeout_s=10)
    try:
        results = []
        for seq in (1, 2, 3):
            channels.send(seq, b"call")
            results.append(read(channels))
        assert [seq for seq, _reply in results] == [1, 2, 3]
        results = [reply for _seq, reply in results]
        assert results == [b"\x80\x05raw", None, failure]
    finally:
        channels.close()


def test_a_stalled_handshake_times_out_instead_of_hanging() -> None:
    # A listener that never accepts: the connection is queued, and its handshake never comes.
    address = f"\0executor-ray-test-{os.urandom(8).hex()}"
    listener = Listener(address, family="AF_UNIX", authkey=b"k" * 32)
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="handshake"):
            DirectChannels([address], b"k" * 32, timeout_s=0.5)
        assert time.monotonic() - start < 5
    finally:
        listener.close()


@pytest.mark.parametrize("host", [None, "127.0.0.1"], ids=["unix", "tcp"])
def test_a_peer_that_connects_and_stalls_neither_locks_the_driver_out_nor_stays(
    host: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_direct, "HANDSHAKE_S", 3.0)
    server = DirectServer(b"k" * 32, lambda call: pack("served"), host)
    family = socket.AF_UNIX if host is None else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as stalled:
        stalled.connect(server.address)  # connects first, then never answers the challenge
        start = time.monotonic()
        channels = DirectChannels([server.address], b"k" * 32, timeout_s=10)
        try:
            assert time.monotonic() - start < 2.5  # not after the stalled peer was dropped
            channels.send(1, b"call")
            assert read(channels) == (1, "served")
        finally:
            channels.close()
        # The worker dropped the stalled peer at the handshake's time limit.
        stalled.settimeout(10)
        while stalled.recv(4096):  # the challenge, then end of stream
            pass
        assert 2.5 < time.monotonic() - start < 12


def test_a_peer_that_answers_the_challenge_with_garbage_is_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    handled: list[bytes] = []
    server = DirectServer(b"k" * 32, lambda call: handled.append(call), "127.0.0.1")
    with socket.create_connection(server.address, timeout=10) as peer:
        peer.recv(4096)  # the challenge
        peer.sendall(struct.pack("!i", 5) + b"hello")  # a framed message, but no digest
        while peer.recv(4096):  # dropped: end of stream
            pass
    assert handled == []
    assert "refused a connection to the direct channel: AuthenticationError" in caplog.text
    channels = DirectChannels([server.address], b"k" * 32, timeout_s=10)  # still served
    channels.close()


@pytest.mark.parametrize("host", [None, "127.0.0.1"], ids=["unix", "tcp"])
def test_the_worker_serves_only_the_first_peer_to_pass_the_handshake(host: str | None) -> None:
    server = DirectServer(b"k" * 32, lambda call: pack("served"), host)
    first = DirectChannels([server.address], b"k" * 32, timeout_s=10)
    try:
        # Served: so the worker has claimed this connection and stopped listening.
        first.send(1, b"call")
        assert read(first) == (1, "served")
        # A second peer, even with the key, cannot connect.
        with pytest.raises(ConnectionRefusedError):
            DirectChannels([server.address], b"k" * 32, timeout_s=2)
        first.send(2, b"call")
        assert read(first) == (2, "served")
    finally:
        first.close()


@pytest.fixture(scope="module")
def executor(ray_local: None) -> Iterator[RayExecutor]:
    created = create_executor(
        conformance_config("ray", world_size=2, backend_options={"log_to_driver": False})
    )
    assert isinstance(created, RayExecutor)
    assert created.uses_direct_calls
    try:
        yield created
    finally:
        created.shutdown()


def test_calls_keep_one_order_across_paths(executor: RayExecutor) -> None:
    executor.collective_rpc("clear_recorded")
    big = b"b" * BIG
    ref = ray.put("stored")  # an object ref goes through Ray's serializer: an actor call
    first = executor.collective_rpc("record", args=(1,), non_block=True)
    executor.collective_rpc("record", args=(big,), non_block=True)
    executor.collective_rpc("record", args=(ref,), non_block=True)
    last = executor.collective_rpc("record", args=(4,), non_block=True)
    assert last.result(timeout=30) == [4, 4]
    assert first.result(timeout=0) == [1, 1]
    for recorded in executor.collective_rpc("get_recorded"):
        assert recorded[0] == 1
        assert recorded[1] == big
        assert isinstance(recorded[2], ray.ObjectRef)
        assert recorded[3] == 4


def test_shutdown_wakes_a_call_waiting_on_the_channel(ray_local: None) -> None:
    executor = create_executor(
        conformance_config("ray", world_size=2, backend_options={"log_to_driver": False})
    )
    pending = executor.collective_rpc("slow", args=(60.0,), non_block=True)
    time.sleep(0.3)
    start = time.monotonic()
    executor.shutdown()
    with pytest.raises(ExecutorClosedError):
        pending.result(timeout=15)
    assert time.monotonic() - start < 10


def _target(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def test_shutdown_closes_the_executors_sockets_and_pipe(executor: RayExecutor) -> None:
    fresh = create_executor(
        conformance_config("ray", world_size=2, backend_options={"log_to_driver": False})
    )
    transport = fresh.transport
    direct = transport._direct
    assert direct is not None
    # Private: the descriptors this executor opened (Ray's own are the session's).
    own = [transport._wake_r, transport._wake_w, *(conn.fileno() for conn in direct._conns)]
    targets = {fd: _target(fd) for fd in own}
    assert all(target is not None for target in targets.values())
    assert fresh.collective_rpc("get_rank") == [0, 1]
    fresh.shutdown()
    assert {fd: _target(fd) for fd in own if _target(fd) == targets[fd]} == {}


def test_a_reader_waiting_on_the_channels_wakes_on_shutdown_and_on_the_wake_fd() -> None:
    server = DirectServer(b"k" * 32, lambda call: pack("served"))
    channels = DirectChannels([server.address], b"k" * 32, timeout_s=10)
    wake_r, wake_w = os.pipe()
    try:
        start = time.monotonic()
        assert channels.wait(0.05, wake_r) == []  # nothing to read: the timeout
        os.write(wake_w, b"x")
        assert channels.wait(10, wake_r) == []  # woken at once
        assert time.monotonic() - start < 5
        channels.shutdown()
        assert channels.wait(10) == [0]  # readable: end of stream
        with pytest.raises(_direct.ChannelClosedError):
            channels.recv(0)
    finally:
        channels.close()
        os.close(wake_r)
        os.close(wake_w)
