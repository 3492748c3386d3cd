"""The dialing end of a link: a :class:`Connection` (zmq DEALER) that presents the gate's
token, opens its session with a HELLO and checks every frame the listener sends."""

from __future__ import annotations

import contextlib
import secrets
import time
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
)
from .gate import dialer_token
from .link import (
    BytesLike,
    ChannelError,
    ChannelTimeoutError,
    LinkEnd,
    Message,
    PeerId,
    as_views,
    deadline_after,
)
from .secret import Secret

__all__ = ["Connection"]


class Connection(LinkEnd):
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
        deadline = deadline_after(timeout)
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
        self._send(self._seal(Kind.DATA, as_views(parts)), timeout)

    def recv(self, timeout: float) -> Message:
        """The next authenticated message from the listener.

        Raises :class:`ChannelTimeoutError` if none arrives within ``timeout`` seconds.
        """
        self._check_open()
        return self._receive(timeout, self._handle)

    def recv_now(self) -> Message | None:
        """The next authenticated message from the listener if one waits now, else None.

        It never waits: what ``recv(0)`` returns, without the
        :class:`ChannelTimeoutError` when nothing waits, for a loop that reads everything
        after each :meth:`wait`.
        """
        self._check_open()
        return self._receive_now(self._handle)

    def close(self) -> None:
        """Tell the listener the session ends (best effort), then close; idempotent."""
        if not self._closed and self._listener is not None:
            # Best effort: with the queue full or the listener gone, the BYE is not needed.
            with contextlib.suppress(ChannelError):
                self._send(self._seal(Kind.BYE, []), 0)
        super().close()

    def _seal(self, kind: Kind, views: list[memoryview]) -> list[bytes | bytearray | memoryview]:
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
        buffers = [frame.buffer for frame in frames]
        header, views = read_frame(buffers, self._limits)
        if header.kind is not kind:
            raise FrameError(DropReason.UNEXPECTED)
        if self._listener is not None and header.session != self._listener:
            raise FrameError(DropReason.UNKNOWN_SESSION)
        if kind is Kind.WELCOME:
            if header.lengths != (NONCE_BYTES,):
                raise FrameError(DropReason.BAD_LENGTHS)
            # The key binds the listener's nonce for this session: the WELCOME carries it,
            # and its tag is checked under it.
            salt = bytes(views[1])
        else:
            salt = self._nonce
        check_fresh(
            self._key,
            Direction.TO_DIALER,
            views,
            header,
            self._client_nonce,
            self._last_sequence,
            salt,
            whole=buffers[0] if len(buffers) == 1 else None,
        )
        self._last_sequence = header.sequence
        return header, views

    def _handle_welcome(self, frames: list[zmq.Frame]) -> Message | None:
        try:
            header, views = self._check(frames, Kind.WELCOME)
        except FrameError as exc:
            self._drops.add("listener", exc.reason)
            return None
        return Message(PeerId(header.session), ((views[1],),))

    def _handle(self, frames: list[zmq.Frame]) -> Message | None:
        try:
            header, views = self._check(frames, Kind.DATA)
        except FrameError as exc:
            self._drops.add("listener", exc.reason)
            return None
        return Message(PeerId(header.session), payload_chunks(views, header))
