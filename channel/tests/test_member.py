"""MemberServer: a member serving one rank itself, against a real Hub in this process."""

from __future__ import annotations

import collections
import logging
import os
import select
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import zmq
from channel_helpers import WAIT

from executor_channel import ChannelError, Listener, Secret
from executor_channel._codec import KIND_READY, KIND_REPLY, KIND_STOP, encode, encode_call
from executor_channel._net.hub import Hub
from executor_channel._net.member import MemberServer
from executor_channel._shm.doorbell import Doorbell
from executor_channel._shm.node_rings import Reply
from executor_core import ExecutorError, ExecutorFailedError, WorkerDiedError
from executor_core.backend import RemoteFailure

VERSION = "9.9.9"
RANK = 3


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _threads() -> set[threading.Thread]:
    # pyzmq starts one garbage collector thread per process for zero-copy sends, for good.
    return {t for t in threading.enumerate() if type(t).__name__ != "GarbageCollectorThread"}


@pytest.fixture(scope="module")
def zmq_warm() -> None:
    """Start what pyzmq keeps for the whole process once a zero-copy message was sent (its
    garbage collector: a thread, a context, a socket), so it is not counted as a leak."""
    context: zmq.Context[Any] = zmq.Context()
    with context.socket(zmq.PAIR) as a, context.socket(zmq.PAIR) as b:
        a.bind("inproc://warm")
        b.connect("inproc://warm")
        a.send(b"x" * 100_000, copy=False)
        b.recv()
    context.term()


@pytest.fixture(autouse=True)
def no_leaks(zmq_warm: None) -> Iterator[None]:
    """Every test leaves no thread and no descriptor behind."""
    threads = _threads()
    fds = _fds()
    yield
    deadline = time.monotonic() + WAIT
    while _threads() - threads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _threads() - threads == set()
    # zmq's threads close their descriptors as the contexts terminate: give them a moment.
    while _fds() - fds and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _fds() - fds == set()


def echo_handler(method: Any, args: Any, kwargs: Any, reply_rank: int | None) -> Any:
    """Doubles ``args[0]`` for "double", fails for "fail", raises for "raise", sleeps for
    "slow"; answers only if ``reply_rank`` is None or this rank, as WorkerWrapper does."""
    if method == "fail":
        return False, "it failed"
    if method == "raise":
        raise ValueError("the handler raised")
    if method == "slow":
        time.sleep(args[0])
    if reply_rank is not None and reply_rank != RANK:
        return None
    if method == "double":
        return True, args[0] * 2
    return True, (method, args, kwargs)


class Driver:
    """A hub with one member joined for RANK, started and told every rank is ready."""

    def __init__(self, hub: Hub, member: MemberServer, failures: list[ExecutorFailedError]):
        self.hub = hub
        self.member = member
        self.failures = failures
        self.seq = 0

    def call(self, method: Any, *args: Any, reply_rank: int = -1, **kwargs: Any) -> int:
        self.seq += 1
        self.hub.broadcast(encode_call(reply_rank, self.seq, method, args, kwargs)[0])
        return self.seq

    def stop_frame(self) -> None:
        self.hub.broadcast(encode(KIND_STOP, True, -1, 0, None)[0])

    def replies(self, count: int, timeout: float = WAIT, read: bool = True) -> list[Reply]:
        """Wait for ``count`` replies as the driver's poll does: reading them itself, woken
        by the link or the doorbell; with ``read`` false, only the doorbell (the pump reads)."""
        got: list[Reply] = []
        deadline = time.monotonic() + timeout
        poll = select.poll()
        poll.register(self.hub.reply_bell.fd, select.POLLIN)
        if read:
            poll.register(self.hub.reply_fd, select.POLLIN)
        while len(got) < count:
            if read:
                self.hub.read_replies()
            while self.hub.inbox and len(got) < count:
                got.append(self.hub.inbox.popleft())
            remaining = deadline - time.monotonic()
            if len(got) < count:
                assert remaining > 0, f"{len(got)} of {count} replies arrived"
                if poll.poll(remaining * 1000):
                    self.hub.reply_bell.clear()
        return got

    def round_trip(self, method: Any, *args: Any) -> Reply:
        seq = self.call(method, *args)
        (reply,) = self.replies(1)
        assert reply[1] == seq
        return reply


def start_member(
    address: str, secret: Secret, handle: Any = echo_handler, **options: Any
) -> tuple[threading.Thread, dict[str, Any]]:
    """Construct a MemberServer in a thread (its constructor blocks until the spec)."""
    box: dict[str, Any] = {}
    kwargs = {"version": VERSION, "node_timeout_s": 2.0, "join_timeout": WAIT, **options}

    def construct() -> None:
        try:
            box["member"] = MemberServer(address, secret, RANK, handle, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the test asserts on it
            box["error"] = exc

    thread = threading.Thread(target=construct, name="test-member-start")
    thread.start()
    return thread, box


@contextmanager
def driver(
    handle: Callable[..., Any] = echo_handler, node_timeout_s: float = 2.0
) -> Iterator[Driver]:
    secret = Secret.generate()
    failures: list[ExecutorFailedError] = []
    with Listener(secret) as listener:
        bell = Doorbell()
        hub = Hub(listener, node_timeout_s, bell, failures.append)
        member: MemberServer | None = None
        try:
            thread, box = start_member(
                listener.address, secret, handle, node_timeout_s=node_timeout_s
            )
            try:
                hub.join([RANK], VERSION, WAIT, "start the member")
                hub.send_spec(hub.nodes[0], "node-x", [RANK], b"")
            finally:
                thread.join(WAIT)
            member = box["member"]
            hub.start()
            hub.ready = True
            hub.wake()
            d = Driver(hub, member, failures)
            (ready,) = d.replies(1)
            assert ready == (KIND_READY, 0, RANK, True, os.getpid())
            yield d
        finally:
            hub.stop(False, 0)
            if member is not None:
                member.stop()
            bell.close()


def test_calls_are_answered_in_order() -> None:
    with driver() as d:
        seqs = [d.call("double", i) for i in range(300)]
        replies = d.replies(300)
        assert [r[1] for r in replies] == seqs
        assert all(r[0] == KIND_REPLY and r[2] == RANK and r[3] for r in replies)
        assert [r[4] for r in replies] == [2 * i for i in range(300)]
        # Keyword arguments and large out-of-band arguments arrive whole.
        blob = os.urandom(100_000)
        reply = d.round_trip("echo", blob)
        assert reply[3]
        assert reply[4] == ("echo", (blob,), {})
        seq = d.call("echo", 1, key="value")
        (reply,) = d.replies(1)
        assert reply[1] == seq
        assert reply[4] == ("echo", (1,), {"key": "value"})
        assert d.failures == []


def test_the_link_thread_reads_the_calls_and_the_call_thread_sends_its_replies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A call crosses one thread hop of the member's: the link thread reads it, the call
    # thread runs it and sends its reply itself (most replies must not wait for the link
    # thread).
    read_by: list[int] = []
    queued: list[object] = []
    real_read, real_queue = MemberServer._read_locked, MemberServer._queue

    def read_locked(self: MemberServer) -> Any:
        read_by.append(threading.get_ident())
        return real_read(self)

    def queue(self: MemberServer, message: Any) -> None:
        queued.append(message)
        real_queue(self, message)

    monkeypatch.setattr(MemberServer, "_read_locked", read_locked)
    monkeypatch.setattr(MemberServer, "_queue", queue)
    with driver() as d:
        read_by.clear()
        for i in range(100):
            assert d.round_trip("double", i)[4] == 2 * i
        link_thread = d.member._link_thread.ident
        assert set(read_by) == {link_thread}
        assert len(queued) <= 50, f"{len(queued)} of 100 replies went through the link thread"
        assert d.failures == []


class _Appends(collections.deque[Reply]):
    """An inbox that records which thread put each reply in it."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[int] = []

    def append(self, reply: Reply) -> None:
        self.threads.append(threading.get_ident())
        super().append(reply)


def test_a_waiting_caller_reads_its_replies_itself() -> None:
    # While a caller waits, the replies reach it with no hand-off from the pump thread: it is
    # woken by the link and reads them. (The pump still looks now and then, so a few may
    # come through it; most must not.)
    with driver() as d:
        inbox = d.hub.inbox = _Appends()
        for i in range(100):
            assert d.round_trip("double", i)[4] == 2 * i
        me = threading.get_ident()
        assert inbox.threads.count(me) >= 50, f"{inbox.threads.count(me)} of 100 read here"
        assert d.failures == []


def test_replies_also_come_through_the_pump() -> None:
    # A poll that only waits on the doorbell (no caller reading) still gets every reply.
    with driver() as d:
        inbox = d.hub.inbox = _Appends()
        seqs = [d.call("double", i) for i in range(50)]
        replies = d.replies(50, read=False)
        assert [r[1] for r in replies] == seqs
        assert threading.get_ident() not in inbox.threads
        assert d.failures == []


def test_what_a_caller_reads_for_the_pump_reaches_it() -> None:
    # A caller that keeps reading takes the member's heartbeats off the link too: it hands
    # them to the pump, or the member would count as silent (node_timeout_s is 2 s here).
    with driver() as d:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            d.hub.read_replies()
            time.sleep(0.001)
        assert d.failures == []
        assert d.round_trip("double", 21)[4] == 42


def test_what_the_caller_can_change_is_copied_at_send() -> None:
    # zmq sends large parts without a copy, from its own thread, later (and the hub's pump
    # sends a call that could not go at once): an array the caller changes right after the
    # call is sent must arrive as it was then; immutable bytes need no copy, and they
    # and the array arrive whole, in order, from a call frame sent in several parts.
    numpy = pytest.importorskip("numpy")
    with driver() as d:
        array = numpy.arange(300_000, dtype=numpy.float32)
        blob = os.urandom(300_000)
        seq = d.call("echo", array, blob, b"small")
        array[:] = -1
        (reply,) = d.replies(1)
        assert reply[1] == seq
        assert reply[3]
        _, (got, got_blob, small), _ = reply[4]
        numpy.testing.assert_array_equal(got, numpy.arange(300_000, dtype=numpy.float32))
        assert (got_blob, small) == (blob, b"small")
        assert d.failures == []


def test_failures_and_reply_rank() -> None:
    with driver() as d:
        reply = d.round_trip("fail")
        assert not reply[3]
        assert reply[4] == "it failed"
        reply = d.round_trip("raise")
        assert not reply[3]
        assert isinstance(reply[4], RemoteFailure)
        assert reply[4].rank == RANK
        assert reply[4].method == "raise"
        assert reply[4].exc_type.endswith("ValueError")
        # Another rank answers: this one stays silent, and the next reply is the next call's.
        d.call("double", 1, reply_rank=RANK + 1)
        seq = d.call("double", 2, reply_rank=RANK)
        (reply,) = d.replies(1)
        assert reply[1] == seq
        assert reply[4] == 4
        assert not d.hub.inbox
        assert d.member.done.is_set() is False


class _Unloadable:
    def __reduce__(self) -> Any:
        return _explode, ()


def _explode() -> None:
    raise RuntimeError("cannot be rebuilt here")


def test_a_call_that_cannot_be_unpickled_is_answered_as_a_failure() -> None:
    with driver() as d:
        seq = d.call("echo", _Unloadable())
        (reply,) = d.replies(1)
        assert reply[1] == seq
        assert not reply[3]
        assert isinstance(reply[4], RemoteFailure)
        assert reply[4].rank == RANK
        assert reply[4].method == "<decode>"
        assert "cannot be rebuilt here" in reply[4].message
        assert d.round_trip("double", 5)[4] == 10  # serving goes on


@pytest.mark.slow  # a call of 2 s under heartbeats
def test_a_slow_call_keeps_heartbeats_then_the_stop_frame_ends_with_bye() -> None:
    with driver(node_timeout_s=0.5) as d:
        d.round_trip("double", 1)  # the hub's READY is out by now: strict timeouts
        start = time.monotonic()
        reply = d.round_trip("slow", 2.0)
        assert reply[3]
        assert time.monotonic() - start >= 2.0
        assert d.failures == []
        # Calls queued before the stop frame are answered before BYE.
        seqs = [d.call("slow", 0.3), d.call("double", 7)]
        d.stop_frame()
        d.hub.stop(True, WAIT)
        assert [r[1] for r in d.replies(2, timeout=0)] == seqs
        assert d.member.done.wait(WAIT)
        assert d.hub.nodes[0].done
        assert not d.hub.nodes[0].lost
        assert d.member.reason == "the driver's stop frame"
        assert d.failures == []


def test_kill_ends_serving_at_once() -> None:
    with driver() as d:
        d.round_trip("double", 1)
        start = time.monotonic()
        d.hub.stop(False, 0)
        assert d.member.done.wait(WAIT)
        assert time.monotonic() - start < 1.0
        assert d.member.reason == "killed by the driver"
        assert d.failures == []


def test_kill_during_a_long_call() -> None:
    with driver() as d:
        d.round_trip("double", 1)
        d.call("slow", 1.0)
        d.call("double", 2)  # queued behind it: dropped
        time.sleep(0.2)
        start = time.monotonic()
        d.hub.stop(False, 0)
        assert d.member.done.wait(WAIT)
        assert time.monotonic() - start < 1.0
        d.member.stop()  # waits for the running call to finish
        assert time.monotonic() - start < WAIT
        assert not d.hub.inbox


def test_a_silent_driver_ends_serving(caplog: pytest.LogCaptureFixture) -> None:
    timeout = 0.5
    with driver(node_timeout_s=timeout) as d:
        d.round_trip("double", 1)
        d.round_trip("double", 2)  # sent after the hub's READY: the member has it
        # The hub forgets the member (no more pings, no KILL), then the driver goes away.
        d.hub.nodes[0].lost = True
        silent_since = time.monotonic()
        d.hub.stop(False, 0)
        d.hub._listener.close()
        with caplog.at_level(logging.ERROR, logger="executor_channel"):
            assert d.member.done.wait(timeout + 2.0)
        assert time.monotonic() - silent_since < timeout + 1.0
        assert d.member.reason.startswith("the driver sent nothing for")
        assert any(
            r.name == "executor_channel" and r.levelno == logging.ERROR for r in caplog.records
        )


def test_stop_tells_the_hub() -> None:
    with driver() as d:
        d.round_trip("double", 1)
        d.member.stop()
        assert d.member.done.is_set()
        assert d.member.reason == "stopped by its owner"
        deadline = time.monotonic() + WAIT
        while not d.failures and time.monotonic() < deadline:
            time.sleep(0.01)
        (failure,) = d.failures
        assert isinstance(failure, WorkerDiedError)
        assert "its member stopped serving" in str(failure)
        d.member.stop()  # idempotent


def test_a_refused_member_raises() -> None:
    secret = Secret.generate()
    with Listener(secret) as listener:
        bell = Doorbell()
        failures: list[ExecutorFailedError] = []
        hub = Hub(listener, 2.0, bell, failures.append)
        thread, box = start_member(listener.address, secret, version="0.0.1")
        try:
            with pytest.raises(ExecutorError, match="did not join"):
                hub.join([RANK], VERSION, 1.0, "start the member")
        finally:
            thread.join(WAIT)
            hub.stop(False, 0)
            bell.close()
    assert isinstance(box.get("error"), ChannelError)
    assert "refused" in str(box["error"])
    assert "0.0.1" in str(box["error"])


def test_a_driver_that_gives_up_before_the_spec() -> None:
    secret = Secret.generate()
    with Listener(secret) as listener:
        bell = Doorbell()
        failures: list[ExecutorFailedError] = []
        hub = Hub(listener, 2.0, bell, failures.append)
        thread, box = start_member(listener.address, secret)
        try:
            hub.join([RANK], VERSION, WAIT, "start the member")
            hub.stop(False, 0)  # never started: KILL to who joined
        finally:
            thread.join(WAIT)
            bell.close()
    assert isinstance(box.get("error"), ChannelError)
    assert "gave up" in str(box["error"])


def test_no_driver() -> None:
    # A listener with another secret never answers the handshake.
    with (
        Listener(Secret.generate()) as listener,
        pytest.raises(ChannelError, match="no handshake answer"),
    ):
        MemberServer(
            listener.address,
            Secret.generate(),
            RANK,
            echo_handler,
            version=VERSION,
            node_timeout_s=1.0,
            join_timeout=0.3,
        )


def test_a_member_reports_its_start_up_failure_with_its_traceback() -> None:
    """``prepare`` raising: the hub's ready wait gets the failure (as a worker's start-up
    failure in another process), and the constructor raises."""
    secret = Secret.generate()
    failures: list[ExecutorFailedError] = []

    def prepare() -> None:
        raise RuntimeError("no device for this rank")

    with Listener(secret) as listener:
        bell = Doorbell()
        hub = Hub(listener, 2.0, bell, failures.append)
        try:
            thread, box = start_member(listener.address, secret, prepare=prepare)
            members = hub.join([RANK], VERSION, WAIT, "start the member")
            assert [m.node_rank for m in members] == [RANK]
            hub.send_spec(members[0], "node-x", [RANK], b"")
            thread.join(WAIT)
            assert "member" not in box
            assert isinstance(box["error"], ChannelError)
            assert "RuntimeError: no device for this rank" in str(box["error"])
            hub.start()
            d = Driver(hub, None, failures)  # type: ignore[arg-type]
            (ready,) = d.replies(1)
            kind, _, rank, ok, failure = ready
            assert (kind, rank, ok) == (KIND_READY, RANK, False)
            error = failure.to_error()
            assert error.method == "prepare"
            assert "no device for this rank" in error.remote_traceback
            assert "in prepare" in error.remote_traceback  # the member's own frame
        finally:
            hub.stop(False, 0)
            bell.close()
