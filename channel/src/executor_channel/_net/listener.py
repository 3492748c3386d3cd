"""The listening end of a link: a :class:`Listener` (zmq ROUTER) behind its gate, which
answers each dialer's HELLO and keeps a bounded table of the sessions it opened."""

from __future__ import annotations

import logging
import secrets
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import zmq

from .frames import (
    NONCE_BYTES,
    ZERO_NONCE,
    Direction,
    DropReason,
    FrameError,
    Header,
    Kind,
    Limits,
    check_fresh,
    payload_chunks,
    read_frame,
    seal,
    verify,
)
from .link import BytesLike, ChannelError, LinkEnd, Message, PeerId, as_views
from .secret import Secret

__all__ = ["LOOPBACK", "Listener"]

log = logging.getLogger("executor_channel")

#: Where a :class:`Listener` binds unless told otherwise: only this machine can connect.
LOOPBACK = "127.0.0.1"


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


class Listener(LinkEnd):
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

    def recv_now(self) -> Message | None:
        """The next authenticated message from any peer if one waits now, else None.

        It never waits: what ``recv(0)`` returns, without the
        :class:`ChannelTimeoutError` when nothing waits, for a loop that reads everything
        after each :meth:`wait`. Answers handshakes and drops bad frames it finds.
        """
        self._check_open()
        return self._receive_now(self._handle)

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
        views = as_views(parts)
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
            salt=session.nonce,
        )
        self._send([session.routing_id, *frames], timeout)

    def _handle(self, frames: list[zmq.Frame]) -> Message | None:
        routing_id = frames[0].bytes
        buffers = [frame.buffer for frame in frames[1:]]
        try:
            header, views = read_frame(buffers, self._limits)
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
                whole=buffers[0] if len(buffers) == 1 else None,
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
        return Message(PeerId(header.session), payload_chunks(views, header))

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
            salt=session.nonce,
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
