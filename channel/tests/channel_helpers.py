"""Shared pieces of the channel tests: a listener loop in a thread, frame capture, raw sockets,
a ring's ends in a fresh segment."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import zmq

from executor_channel import ChannelTimeoutError, Connection, Doorbell, Listener
from executor_channel._net.link import Message
from executor_channel._shm.ring import Ring, RingLayout
from executor_channel._shm.segment import SharedSegment
from executor_channel._shm.slot_views import SlotViews

# Every wait in these tests is bounded by this (a hung test fails instead of blocking CI).
WAIT = 10.0

Reply = Callable[[Message], Sequence[bytes | memoryview] | None]


class Server:
    """Runs ``listener.recv`` in a thread; hands each message to ``handle``, sends its reply.

    The listener is used only by this thread while it runs (a zmq socket is not thread-safe).
    """

    def __init__(self, listener: Listener, handle: Reply) -> None:
        self.listener = listener
        self.handle = handle
        self.errors: list[BaseException] = []
        self.loops = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="channel-test-server", daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.loops += 1
                try:
                    message = self.listener.recv(timeout=0.05)
                except ChannelTimeoutError:
                    continue
                reply = self.handle(message)
                if reply is not None:
                    self.listener.send(message.peer, reply, timeout=WAIT)
        except BaseException as exc:
            self.errors.append(exc)  # for the test to assert on; pytest also reports it
            raise

    def __enter__(self) -> Server:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self.thread.join(WAIT)
        assert not self.thread.is_alive(), "the listener loop did not stop"


@contextmanager
def wire_tap(cls: type[Listener] | type[Connection]) -> Iterator[list[list[bytes]]]:
    """Record (as bytes) every frame any ``cls`` sends while open, as a wire tap would.

    Patches the class, so the handshake of a Connection created inside is recorded too.
    """
    captured: list[list[bytes]] = []
    original = cls._send

    def tap(self: Any, frames: Sequence[bytes | memoryview], timeout: float) -> None:
        parts = [bytes(frame) for frame in frames]
        # A listener's frames start with the zmq routing id, which never crosses the wire.
        captured.append(parts[1:] if isinstance(self, Listener) else parts)
        original(self, frames, timeout)

    cls._send = tap  # type: ignore[method-assign]
    try:
        yield captured
    finally:
        cls._send = original  # type: ignore[method-assign]


@contextmanager
def raw_dealers(
    address: str, count: int, token: tuple[bytes, bytes] | None = None
) -> Iterator[list[zmq.Socket[Any]]]:
    """``count`` plain zmq DEALER sockets connected to ``address``: peers without a secret.

    With ``token`` (:func:`executor_channel.testing.gate_token`) they pass the listener's
    gate, as an observer who captured a dialer's token could, and their frames meet the
    link's checks; without it zmq refuses them in its handshake.
    """
    context: zmq.Context[Any] = zmq.Context()
    sockets: list[zmq.Socket[Any]] = []
    try:
        for _ in range(count):
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, int(WAIT * 1000))
            if token is not None:
                sock.setsockopt(zmq.PLAIN_USERNAME, token[0])
                sock.setsockopt(zmq.PLAIN_PASSWORD, token[1])
            sock.connect(address)
            sockets.append(sock)
        yield sockets
    finally:
        for sock in sockets:
            sock.close()
        context.term()


class RingEnds:
    """A writer and ``readers`` readers on one ring in a fresh segment; with ``views``, each
    reader reads in place through slot views of its own (as a worker reads its calls)."""

    def __init__(self, slots: int, slot_bytes: int, readers: int, views: bool = False) -> None:
        layout = RingLayout(0, readers, slots, slot_bytes)
        self.segment = SharedSegment.create(layout.nbytes)
        data = [Doorbell() for _ in range(readers)]
        space = Doorbell()
        self.bells = [*data, space]
        buf = self.segment.buf
        self.writer = Ring(buf, layout, reader=None, data_bells=data, space_bell=space)
        self.views: list[SlotViews | None] = [
            SlotViews.open(self.segment.fd, layout) if views else None for _ in range(readers)
        ]
        self.readers = [
            Ring(buf, layout, reader=i, data_bells=[data[i]], space_bell=space, views=own)
            for i, own in enumerate(self.views)
        ]

    def close(self) -> None:
        for views in self.views:
            if views is not None:
                views.close()
        for bell in self.bells:
            bell.close()
        self.segment.close()
