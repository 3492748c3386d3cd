"""Authenticated links between nodes: a :class:`Listener` (zmq ROUTER) and its dialers.

A :class:`Connection` (zmq DEALER) opens a session with a handshake, then both sides exchange
messages, each a sequence of bytes-like parts. The link never unpickles anything: it hands
the caller only parts whose frame passed every check of :mod:`._frames` and the freshness
checks below. Frames that fail are dropped, counted per :class:`DropReason` (``drops``), and
logged through ``logging.getLogger("executor_channel")``: one warning for the first drop from
each peer (a zmq connection), debug records after that. A peer's bytes never raise out of
``recv``.

Handshake (all frames signed, see :mod:`._frames`)::

    dialer                                         listener (epoch id L, random per bind)
      HELLO   session=S epoch=0 seq=1 [C]  ---->   new session S; picks nonce N (random)
              <----  WELCOME session=L epoch=C seq=1 [N]
      DATA    session=S epoch=N seq=2,3,...  ---->
              <----  DATA    session=L epoch=C seq=2,3,...
      BYE     session=S epoch=N seq=k  ---->       forgets session S

``S`` and ``C`` are random per :class:`Connection`; ``N`` is random per session and per
listener lifetime. Guarantees, for anyone who does not hold the secret:

* *Authenticity*: a frame is delivered only if its MAC verifies under the secret, and a MAC
  binds the direction, so a listener's frame cannot be reflected back to it.
* *No replay within a session*: a frame is delivered only if its sequence number is above the
  last one delivered from that session; a dialer never sends a second HELLO, so a replayed
  HELLO for an open session is dropped too.
* *No replay across sessions or lifetimes*: frames from a dialer bind ``N``, which this
  listener issued for this session; frames from a listener bind ``C``, which this dialer
  picked. A frame captured in an earlier session or from an earlier listener (even one on
  the same port with the same secret) is dropped as ``unknown_session`` or ``wrong_epoch``.
  A replayed HELLO (it binds no nonce) at most opens a session that no one can use: its
  WELCOME goes to the replayer, who cannot sign for ``N``; it holds one slot until evicted.
* Frames are authenticated, **not encrypted**: an observer of the network reads payloads.

Neither class is thread-safe (nor is a zmq socket): use each from one thread at a time. A
listener answers handshakes inside :meth:`Listener.recv`, so its owner should call ``recv``
while dialers connect. ``drops`` may be read from any thread.
"""

from __future__ import annotations

import contextlib
import logging
import math
import pickle
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NewType, TypeVar

import attrs
import zmq

from ._frames import (
    HEADER_FIXED,
    NONCE_BYTES,
    ZERO_NONCE,
    Direction,
    DropReason,
    FrameError,
    Header,
    Kind,
    Limits,
    check_fresh,
    parse_header,
    payload_parts,
    seal,
    verify,
)
from ._gate import Gate, dialer_token
from ._secret import Secret

__all__ = [
    "LOOPBACK",
    "BytesLike",
    "ChannelError",
    "ChannelTimeoutError",
    "Connection",
    "Listener",
    "Message",
    "PeerId",
]

log = logging.getLogger("executor_channel")

#: Where a :class:`Listener` binds unless told otherwise: only this machine can connect.
LOOPBACK = "127.0.0.1"

#: Identifies the other end of a session: the dialer's session id at a listener, the
#: listener's epoch id at a connection. Opaque bytes.
PeerId = NewType("PeerId", bytes)

#: What a message part may be: anything exposing a C-contiguous buffer.
BytesLike = bytes | bytearray | memoryview | pickle.PickleBuffer

# How long closing waits for queued frames to leave: enough for a last reply or a BYE to reach
# a live peer, short enough that close never stalls on a dead one.
_CLOSE_LINGER_MS = 100
# Peers that get their own warning; beyond this one more warning says the rest are silent, so
# a flood of connections cannot flood the log.
_MAX_WARNED_PEERS = 1024


_LinkT = TypeVar("_LinkT", bound="_Link")


class ChannelError(Exception):
    """A link operation failed (closed link, unknown or unreachable peer, bind failure)."""


class ChannelTimeoutError(ChannelError, TimeoutError):
    """A send, receive or handshake did not complete within its timeout."""


@attrs.frozen
class Message:
    """An authenticated message: who sent it and its parts.

    The parts are zero-copy views of the received zmq frames; they stay valid as long as
    they are referenced.
    """

    peer: PeerId
    parts: tuple[memoryview, ...]


def _deadline(timeout: float) -> float:
    if not math.isfinite(timeout) or timeout < 0:
        raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout!r}")
    return time.monotonic() + timeout


def _as_views(parts: Sequence[BytesLike]) -> list[memoryview]:
    if isinstance(parts, (bytes, bytearray, memoryview)):
        raise TypeError("parts is a sequence of bytes-like parts: wrap a single buffer in a list")
    views = []
    for part in parts:
        view = memoryview(part)
        if not view.c_contiguous:
            raise ValueError("message parts must be C-contiguous buffers")
        views.append(view if view.format == "B" and view.ndim == 1 else view.cast("B"))
    return views


class _Drops:
    """Counts dropped frames per reason; warns once per peer."""

    def __init__(self, side: str, fingerprint: str) -> None:
        #: Peers are routing ids (bytes) at a listener, one name at a connection.
        self._side = side
        self._fingerprint = fingerprint
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._warned: set[bytes | str] = set()
        self._overflowed = False

    def add(self, peer: bytes | str, reason: DropReason) -> None:
        """Count a drop from ``peer`` (a zmq routing id, or a name); warn if it is the first."""
        with self._lock:
            self._counts[reason.value] += 1
            first = peer not in self._warned and len(self._warned) < _MAX_WARNED_PEERS
            if first:
                self._warned.add(peer)
            overflow = not first and peer not in self._warned and not self._overflowed
            if overflow:
                self._overflowed = True
        name = peer.hex() if isinstance(peer, bytes) else peer
        if first and reason in (DropReason.GATE, DropReason.PENDING):
            log.warning(
                "%s refused %s (%s); later refusals are only counted. A connection is served "
                "only if it proves in zmq's handshake that it holds the same secret "
                "(fingerprint %s here).",
                self._side,
                name,
                reason.value,
                self._fingerprint,
            )
        elif first:
            log.warning(
                "%s dropped a frame from peer %s (%s); later drops from this peer are only "
                "counted. A peer is served only if it holds the same secret (fingerprint %s "
                "here) and sends fresh, intact frames.",
                self._side,
                name,
                reason.value,
                self._fingerprint,
            )
        elif overflow:
            log.warning(
                "%s: more than %d peers sent frames that were dropped; further peers are "
                "only counted",
                self._side,
                _MAX_WARNED_PEERS,
            )
        else:
            log.debug("%s dropped a frame from peer %s (%s)", self._side, name, reason.value)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class _Link:
    """What both ends share: the socket, its poller, timeouts, drops and closing."""

    def __init__(
        self,
        secret: Secret,
        limits: Limits,
        context: zmq.Context[Any] | None,
        socket_type: int,
        side: str,
    ) -> None:
        if not isinstance(secret, Secret):
            raise TypeError(f"secret must be an executor_channel.Secret, got {type(secret)}")
        self._key = secret.key
        self._limits = limits
        self._closed = False
        self._drops = _Drops(side, secret.fingerprint)
        self._own_context = context is None
        self._context: zmq.Context[Any] = zmq.Context() if context is None else context
        try:
            self._socket: zmq.Socket[Any] = self._context.socket(socket_type)
        except BaseException:
            if self._own_context:
                self._context.term()
            raise
        try:
            self._socket.setsockopt(zmq.LINGER, _CLOSE_LINGER_MS)
            self._socket.setsockopt(zmq.SNDHWM, limits.hwm)
            self._socket.setsockopt(zmq.RCVHWM, limits.hwm)
            # zmq drops (and disconnects) a peer sending a part larger than this before it is
            # buffered whole: no part a holder of the secret sends is larger than a chunk or
            # than the header (with its lengths).
            header_max = HEADER_FIXED.size + 8 * limits.max_parts
            self._socket.setsockopt(zmq.MAXMSGSIZE, max(limits.chunk_bytes, header_max))
        except BaseException:
            self._socket.close(linger=0)
            if self._own_context:
                self._context.term()
            raise
        self._gate: Gate | None = None
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._wait_pollers: dict[tuple[int, ...], zmq.Poller] = {}

    def _add_gate(self) -> None:
        """Put a :class:`Gate` in front of this (listening, not yet bound) socket."""
        try:
            self._gate = Gate(self._key, self._context, self._socket, self._limits, self._drops.add)
        except RuntimeError as exc:
            raise ChannelError(str(exc)) from None
        for sock in self._gate.sockets:
            self._poller.register(sock, zmq.POLLIN)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def drops(self) -> Mapping[str, int]:
        """Frames dropped so far, per :class:`DropReason` value (a copy; any thread)."""
        return self._drops.snapshot()

    def close(self) -> None:
        """Close the socket (and the context this link created); idempotent, never hangs.

        Frames still queued get a short linger to leave, then are discarded.
        """
        if self._closed:
            return
        self._closed = True
        self._poller = zmq.Poller()
        self._wait_pollers.clear()
        if self._gate is not None:
            self._gate.close()
        self._socket.close(linger=_CLOSE_LINGER_MS)
        if self._own_context:
            self._context.term()

    def __enter__(self: _LinkT) -> _LinkT:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ChannelError(f"{type(self).__name__} is closed")

    def _send(self, frames: Sequence[bytes | memoryview], timeout: float) -> None:
        """Queue one multipart message, waiting up to ``timeout`` for room below the HWM."""
        _deadline(timeout)
        self._socket.setsockopt(zmq.SNDTIMEO, math.ceil(timeout * 1000))
        try:
            # copy=False: pyzmq hands large parts to zmq without copying them (it still copies
            # small ones, which is cheaper than tracking them); track=False: no completion
            # tracking, so a caller must not modify a part after sending it.
            self._socket.send_multipart(frames, copy=False, track=False)
        except zmq.Again:
            raise ChannelTimeoutError(
                f"could not send within {timeout}s: {self.limits.hwm} messages are already "
                "queued for the peer (it is not reading, or the network is slower than the "
                "sender)"
            ) from None
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise ChannelError(
                    "the peer is not connected (it closed, or its connection dropped and it "
                    "has not sent since reconnecting)"
                ) from None
            raise ChannelError(f"send failed: {exc}") from exc

    def _receive(
        self, timeout: float, handle: Callable[[list[zmq.Frame]], Message | None]
    ) -> Message:
        """The first message ``handle`` accepts, blocking in zmq poll up to ``timeout``."""
        deadline = _deadline(timeout)
        while True:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ChannelTimeoutError(f"no message within {timeout}s") from None
                events = self._poller.poll(max(1, math.ceil(remaining * 1000)))
                if self._gate is not None and any(sock is not self._socket for sock, _ in events):
                    self._gate.service()
                continue
            message = handle(frames)
            if message is not None:
                return message
            if time.monotonic() >= deadline:
                raise ChannelTimeoutError(f"no message within {timeout}s")

    @property
    def limits(self) -> Limits:
        """The limits this link enforces."""
        return self._limits

    def wait(self, timeout: float, fds: Sequence[int] = ()) -> tuple[bool, list[int]]:
        """Block (in zmq poll, no spinning) until a frame waits on this link, one of ``fds``
        (plain file descriptors: an eventfd, a pipe) is readable, or ``timeout`` passes.

        Returns ``(frames_waiting, readable_fds)``. A waiting frame may still be dropped: read
        with ``recv(0)`` until it raises :class:`ChannelTimeoutError`. This lets one thread
        own a link and also wake for work of its own, since a link is not thread-safe.
        """
        self._check_open()
        deadline = _deadline(timeout)
        poller = self._wait_pollers.get(tuple(fds))
        if poller is None:
            poller = zmq.Poller()
            poller.register(self._socket, zmq.POLLIN)
            for fd in fds:
                poller.register(fd, zmq.POLLIN)
            for sock in self._gate.sockets if self._gate is not None else ():
                poller.register(sock, zmq.POLLIN)
            self._wait_pollers[tuple(fds)] = poller
        while True:
            events = dict(poller.poll(math.ceil(max(0.0, deadline - time.monotonic()) * 1000)))
            ready = [fd for fd in fds if events.get(fd)]
            frames_waiting = bool(events.get(self._socket))
            if self._gate is not None and len(events) > frames_waiting + len(ready):
                self._gate.service()
            # Woken only by the gate: the caller's wait is not over.
            if frames_waiting or ready or not events or time.monotonic() >= deadline:
                return frames_waiting, ready


class _Session:
    """A listener's state for one dialer session."""

    __slots__ = ("client_nonce", "last_sequence", "nonce", "routing_id", "sent", "used")

    def __init__(self, client_nonce: bytes, sequence: int, routing_id: bytes) -> None:
        self.client_nonce = client_nonce
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.last_sequence = sequence
        self.routing_id = routing_id
        self.sent = 0
        self.used = False


class Listener(_Link):
    """Accepts authenticated sessions from :class:`Connection` dialers (a zmq ROUTER).

    Binds ``host`` (default :data:`LOOPBACK`: only this machine can connect; give an address
    of a network interface, or ``"0.0.0.0"``, to accept other nodes) on ``port`` (default 0:
    the OS picks a free one; see :attr:`port`). ``limits`` bounds what peers can make it
    accept and queue (:class:`Limits`). ``context`` shares a zmq context; without it the
    listener creates one and terminates it on :meth:`close`.
    """

    def __init__(
        self,
        secret: Secret,
        *,
        host: str = LOOPBACK,
        port: int = 0,
        limits: Limits | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        super().__init__(
            secret, limits or Limits(), context, zmq.ROUTER, "executor_channel listener"
        )
        try:
            # Replies to a peer that is gone raise instead of vanishing; a full queue blocks
            # (up to the send timeout) instead of dropping.
            self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
            # Before the socket binds, so that no connection comes in ungated.
            self._add_gate()
            if ":" in host:
                self._socket.setsockopt(zmq.IPV6, 1)
                endpoint = f"tcp://[{host}]:{port or '*'}"
            else:
                endpoint = f"tcp://{host}:{port or '*'}"
            try:
                self._socket.bind(endpoint)
            except zmq.ZMQError as exc:
                raise ChannelError(f"cannot listen on {endpoint}: {exc}") from exc
            self._address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            self.close()
            raise
        self._port = int(self._address.rsplit(":", 1)[1])
        assert self._gate is not None  # added above
        self._gate.bound(self._port)
        self._epoch = secrets.token_bytes(NONCE_BYTES)
        # Least recently active first, for eviction.
        self._sessions: OrderedDict[bytes, _Session] = OrderedDict()

    @property
    def address(self) -> str:
        """The bound endpoint, ``tcp://host:port``, for :class:`Connection`."""
        return self._address

    @property
    def port(self) -> int:
        """The bound TCP port."""
        return self._port

    @property
    def peers(self) -> tuple[PeerId, ...]:
        """The sessions open now (handshake done, no BYE yet), least recently active first."""
        return tuple(PeerId(session) for session in self._sessions)

    def recv(self, timeout: float) -> Message:
        """The next authenticated message from any peer.

        Answers handshakes and drops bad frames while it waits. Raises
        :class:`ChannelTimeoutError` if no message arrives within ``timeout`` seconds.
        """
        self._check_open()
        return self._receive(timeout, self._handle)

    def send(self, peer: PeerId, parts: Sequence[BytesLike], timeout: float) -> None:
        """Send one message to ``peer``, waiting up to ``timeout`` for queue room.

        Large parts are sent without a copy: do not modify them afterwards (a part changed
        before zmq has sent it fails verification, and the receiver drops the message).

        Raises :class:`ChannelError` if the session is unknown or its connection is gone,
        :class:`ChannelTimeoutError` if its queue stays full.
        """
        self._check_open()
        session = self._sessions.get(peer)
        if session is None:
            raise ChannelError(f"no open session {peer.hex()} (it closed or was evicted)")
        views = _as_views(parts)
        session.sent += 1
        frames = seal(
            self._key,
            Direction.TO_DIALER,
            Kind.DATA,
            session=self._epoch,
            epoch=session.client_nonce,
            sequence=session.sent,
            parts=views,
            chunk_bytes=self._limits.chunk_bytes,
        )
        self._send([session.routing_id, *frames], timeout)

    def _handle(self, frames: list[zmq.Frame]) -> Message | None:
        routing_id = frames[0].bytes
        views = [frame.buffer for frame in frames[1:]]
        try:
            header = parse_header(views, self._limits)
            if header.kind is Kind.HELLO:
                self._hello(routing_id, header, views)
                return None
            if header.kind is Kind.WELCOME:
                raise FrameError(DropReason.UNEXPECTED)
            session = self._sessions.get(header.session)
            if session is None:
                raise FrameError(DropReason.UNKNOWN_SESSION)
            check_fresh(
                self._key,
                Direction.TO_LISTENER,
                views,
                header,
                session.nonce,
                session.last_sequence,
            )
        except FrameError as exc:
            self._drops.add(routing_id, exc.reason)
            return None
        session.last_sequence = header.sequence
        # The connection that last sent a fresh authentic frame gets the replies: a dialer
        # that reconnects (a new zmq routing id) is found again by its next message.
        session.routing_id = routing_id
        session.used = True
        self._sessions.move_to_end(header.session)
        if header.kind is Kind.BYE:
            del self._sessions[header.session]
            return None
        return Message(PeerId(header.session), payload_parts(views, header))

    def _hello(self, routing_id: bytes, header: Header, views: list[memoryview]) -> None:
        if header.epoch != ZERO_NONCE:
            raise FrameError(DropReason.WRONG_EPOCH)
        if header.lengths != (NONCE_BYTES,):
            raise FrameError(DropReason.BAD_LENGTHS)
        if header.session in self._sessions:
            # A dialer sends one HELLO per session: a second is a replay.
            raise FrameError(DropReason.REPLAYED)
        if not verify(self._key, Direction.TO_LISTENER, views):
            raise FrameError(DropReason.BAD_MAC)
        self._evict()
        session = _Session(bytes(views[1]), header.sequence, routing_id)
        self._sessions[header.session] = session
        session.sent += 1
        welcome = seal(
            self._key,
            Direction.TO_DIALER,
            Kind.WELCOME,
            session=self._epoch,
            epoch=session.client_nonce,
            sequence=session.sent,
            parts=[memoryview(session.nonce)],
        )
        try:
            self._socket.send_multipart([routing_id, *welcome], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # The dialer is gone or not reading; it will time out its handshake.
            log.debug("could not answer a handshake from %s: %s", routing_id.hex(), exc)

    def _evict(self) -> None:
        if len(self._sessions) < self._limits.max_peers:
            return
        # Sessions that never sent a message go first (a replayed HELLO opens one of those).
        victim = next((key for key, s in self._sessions.items() if not s.used), None)
        if victim is None:
            victim = next(iter(self._sessions))
            log.warning(
                "executor_channel listener: more than %d sessions; closing the least recently "
                "active one (%s)",
                self._limits.max_peers,
                victim.hex(),
            )
        del self._sessions[victim]


class Connection(_Link):
    """A dialer's authenticated session with a :class:`Listener` (a zmq DEALER).

    Connects to ``address`` (``tcp://host:port``, as :attr:`Listener.address` gives it) and
    completes the handshake within ``timeout`` seconds, or raises
    :class:`ChannelTimeoutError` (no listener there, or one with another secret: a listener
    never answers a frame it cannot authenticate). zmq reconnects by itself if the TCP
    connection drops. ``limits`` and ``context`` mean what they mean for :class:`Listener`.
    """

    def __init__(
        self,
        address: str,
        secret: Secret,
        *,
        timeout: float = 30.0,
        limits: Limits | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        if not address.startswith("tcp://"):
            raise ValueError(f"address must look like tcp://host:port, got {address!r}")
        deadline = _deadline(timeout)
        super().__init__(
            secret,
            limits or Limits(),
            context,
            zmq.DEALER,
            f"executor_channel connection to {address}",
        )
        self._address = address
        self._session = secrets.token_bytes(NONCE_BYTES)
        self._client_nonce = secrets.token_bytes(NONCE_BYTES)
        self._sent = 1
        self._listener: bytes | None = None
        self._nonce = ZERO_NONCE
        self._last_sequence = 0
        try:
            if "[" in address:
                self._socket.setsockopt(zmq.IPV6, 1)
            # The gate's token, presented in zmq's handshake (and again on each reconnect).
            username, password = dialer_token(self._key)
            self._socket.setsockopt(zmq.PLAIN_USERNAME, username)
            self._socket.setsockopt(zmq.PLAIN_PASSWORD, password)
            self._socket.connect(address)
            hello = seal(
                self._key,
                Direction.TO_LISTENER,
                Kind.HELLO,
                session=self._session,
                epoch=ZERO_NONCE,
                sequence=self._sent,
                parts=[memoryview(self._client_nonce)],
            )
            self._send(hello, max(0.0, deadline - time.monotonic()))
            welcome = self._receive(max(0.0, deadline - time.monotonic()), self._handle_welcome)
        except ChannelTimeoutError:
            self.close()
            raise ChannelTimeoutError(
                f"no handshake answer from {address} within {timeout}s: is a listener running "
                f"there, and does it hold the same secret (fingerprint {secret.fingerprint} "
                "here)? A listener drops frames it cannot authenticate without answering."
            ) from None
        except BaseException:
            self.close()
            raise
        self._listener = welcome.peer
        self._nonce = bytes(welcome.parts[0])

    @property
    def address(self) -> str:
        """The listener's endpoint."""
        return self._address

    @property
    def peer(self) -> PeerId:
        """The listener's epoch id (random per listener lifetime)."""
        assert self._listener is not None  # set by the handshake in __init__
        return PeerId(self._listener)

    def send(self, parts: Sequence[BytesLike], timeout: float) -> None:
        """Send one message to the listener, waiting up to ``timeout`` for queue room.

        Large parts are sent without a copy: do not modify them afterwards (a part changed
        before zmq has sent it fails verification, and the receiver drops the message).

        Raises :class:`ChannelTimeoutError` if the queue (``limits.hwm`` messages) stays full.
        """
        self._check_open()
        self._send(self._seal(Kind.DATA, _as_views(parts)), timeout)

    def recv(self, timeout: float) -> Message:
        """The next authenticated message from the listener.

        Raises :class:`ChannelTimeoutError` if none arrives within ``timeout`` seconds.
        """
        self._check_open()
        return self._receive(timeout, self._handle)

    def close(self) -> None:
        """Tell the listener the session ends (best effort), then close; idempotent."""
        if not self._closed and self._listener is not None:
            # Best effort: with the queue full or the listener gone, the BYE is not needed.
            with contextlib.suppress(ChannelError):
                self._send(self._seal(Kind.BYE, []), 0)
        super().close()

    def _seal(self, kind: Kind, views: list[memoryview]) -> list[bytes | memoryview]:
        self._sent += 1
        return seal(
            self._key,
            Direction.TO_LISTENER,
            kind,
            session=self._session,
            epoch=self._nonce,
            sequence=self._sent,
            parts=views,
            chunk_bytes=self._limits.chunk_bytes,
        )

    def _check(self, frames: list[zmq.Frame], kind: Kind) -> tuple[Header, list[memoryview]]:
        views = [frame.buffer for frame in frames]
        header = parse_header(views, self._limits)
        if header.kind is not kind:
            raise FrameError(DropReason.UNEXPECTED)
        if self._listener is not None and header.session != self._listener:
            raise FrameError(DropReason.UNKNOWN_SESSION)
        check_fresh(
            self._key, Direction.TO_DIALER, views, header, self._client_nonce, self._last_sequence
        )
        self._last_sequence = header.sequence
        return header, views

    def _handle_welcome(self, frames: list[zmq.Frame]) -> Message | None:
        try:
            header, views = self._check(frames, Kind.WELCOME)
            if header.lengths != (NONCE_BYTES,):
                raise FrameError(DropReason.BAD_LENGTHS)
        except FrameError as exc:
            self._drops.add("listener", exc.reason)
            return None
        return Message(PeerId(header.session), (views[1],))

    def _handle(self, frames: list[zmq.Frame]) -> Message | None:
        try:
            header, views = self._check(frames, Kind.DATA)
        except FrameError as exc:
            self._drops.add("listener", exc.reason)
            return None
        return Message(PeerId(header.session), payload_parts(views, header))
