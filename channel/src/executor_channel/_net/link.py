"""Authenticated links between nodes, as the package imports them: a :class:`Listener` (zmq
ROUTER) and its dialers.

A :class:`Connection` (zmq DEALER) opens a session with a handshake, then both sides exchange
messages, each a sequence of bytes-like parts. The link never unpickles anything: it hands
the caller only parts whose frame passed every check of :mod:`.frames` and the freshness
checks below. Frames that fail are dropped, counted per :class:`DropReason` (``drops``), and
logged through ``logging.getLogger("executor_channel")``: one warning for the first drop from
each peer (a zmq connection), debug records after that. A peer's bytes never raise out of
``recv``.

Here: the link's vocabulary (:data:`PeerId`, :data:`BytesLike`, :class:`Message`, the
errors), what both ends share (:class:`LinkEnd`) and the drop account (:class:`Drops`); the
two ends are :mod:`.listener` and :mod:`.connection`.

Handshake (all frames signed, see :mod:`.frames`)::

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

The drop account (:class:`Drops`) keeps a count per :class:`DropReason` and warns on the
``executor_channel`` logger at the first drop of each peer (debug records after it). One end
of a link, whichever side it is (:class:`LinkEnd`), is a zmq socket held to the
:class:`Limits`, with bounded sends, receives and waits (zmq poll, no spinning) and a close
that never hangs.
"""

from __future__ import annotations

import functools
import logging
import math
import pickle
import select
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NewType, TypeVar, cast

import attrs
import zmq

from .frames import HEADER_FIXED, DropReason, Limits, Pieces, joined
from .gate import Gate
from .secret import Secret

__all__ = [
    "BytesLike",
    "ChannelError",
    "ChannelTimeoutError",
    "Drops",
    "LinkEnd",
    "Message",
    "PeerId",
    "as_views",
    "deadline_after",
]

#: Identifies the other end of a session: the dialer's session id at a listener, the
#: listener's epoch id at a connection. Opaque bytes.
PeerId = NewType("PeerId", bytes)

#: What a message part may be: anything exposing a C-contiguous buffer.
BytesLike = bytes | bytearray | memoryview | pickle.PickleBuffer


class ChannelError(Exception):
    """A link operation failed (closed link, unknown or unreachable peer, bind failure)."""


class ChannelTimeoutError(ChannelError, TimeoutError):
    """A send, receive or handshake did not complete within its timeout."""


@attrs.frozen
class Message:
    """An authenticated message: who sent it and its parts.

    The parts are zero-copy views of the received zmq frames; they stay valid as long as
    they are referenced. A part longer than the sender's chunk size arrives in several zmq
    parts (:attr:`chunks`); :attr:`parts` joins those on first use (one copy), so a receiver
    that only forwards a part (into shared memory, say) can take its chunks instead.
    """

    peer: PeerId
    #: Each part as the zmq parts it arrived in, in order (one view if it came whole).
    chunks: tuple[Pieces, ...]

    @functools.cached_property
    def parts(self) -> tuple[memoryview, ...]:
        """Each part as one buffer."""
        return tuple(joined(pieces) for pieces in self.chunks)


log = logging.getLogger("executor_channel")

# Peers that get their own warning; beyond this one more warning says the rest are silent, so
# a flood of connections cannot flood the log.
_MAX_WARNED_PEERS = 1024


class Drops:
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


# How long closing waits for queued frames to leave: enough for a last reply or a BYE to reach
# a live peer, short enough that close never stalls on a dead one.
_CLOSE_LINGER_MS = 100

_LinkT = TypeVar("_LinkT", bound="LinkEnd")

# Plain ints: pyzmq's enum flags cost an enum operation on every use, on every frame.
_SNDMORE = int(zmq.SNDMORE)

_NOBLOCK = int(zmq.NOBLOCK)

_EVENTS = int(zmq.EVENTS)

_POLLIN = int(zmq.POLLIN)

#: pyzmq's compiled send, and the size below which it copies a part even when asked not to.
# (Its overloads type ``copy`` as a literal; it is decided per part here.)
_send_part = cast(
    Callable[[zmq.Socket[Any], BytesLike, int, bool], object], zmq.backend.Socket.send
)

_COPY = zmq.COPY_THRESHOLD


def deadline_after(timeout: float) -> float:
    """The :func:`time.monotonic` time ``timeout`` seconds from now (a finite number >= 0)."""
    if not math.isfinite(timeout) or timeout < 0:
        raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout!r}")
    return time.monotonic() + timeout


def as_views(parts: Sequence[BytesLike]) -> list[memoryview]:
    """A message's parts as flat byte views, as :func:`.frames.seal` takes them."""
    if isinstance(parts, (bytes, bytearray, memoryview)):
        raise TypeError("parts is a sequence of bytes-like parts: wrap a single buffer in a list")
    views = []
    for part in parts:
        view = memoryview(part)
        if not view.c_contiguous:
            raise ValueError("message parts must be C-contiguous buffers")
        views.append(view if view.format == "B" and view.ndim == 1 else view.cast("B"))
    return views


class LinkEnd:
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
        self._drops = Drops(side, secret.fingerprint)
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
            # Read now, while one thread has the socket (see wait_shared).
            self._signal_fd = cast(int, self._socket.getsockopt(zmq.FD))
        except BaseException:
            self._socket.close(linger=0)
            if self._own_context:
                self._context.term()
            raise
        self._gate: Gate | None = None
        self._send_timeout_ms = -2  # SNDTIMEO as last set (zmq's -1 means no timeout)
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._wait_pollers: dict[tuple[int, ...], zmq.Poller | select.poll] = {}

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

    def _send(self, frames: Sequence[bytes | bytearray | memoryview], timeout: float) -> None:
        """Queue one multipart message, waiting up to ``timeout`` for room below the HWM."""
        deadline_after(timeout)
        timeout_ms = math.ceil(timeout * 1000)
        socket = self._socket
        if timeout_ms != self._send_timeout_ms:
            socket.setsockopt(zmq.SNDTIMEO, timeout_ms)
            self._send_timeout_ms = timeout_ms
        last = len(frames) - 1
        try:
            # Part by part, as pyzmq's send_multipart does, but with plain-int flags (it
            # combines enum flags for every part), and through pyzmq's compiled send, past
            # its Python wrapper (which only adds draft-socket options). A small part is
            # copied (what pyzmq does anyway, but without building a frame object first); a
            # large one goes to zmq without a copy, so a caller must not modify a part
            # after sending it.
            for index, frame in enumerate(frames):
                _send_part(socket, frame, _SNDMORE if index < last else 0, len(frame) < _COPY)
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
        deadline = deadline_after(timeout)
        while True:
            message = self._receive_now(handle)
            if message is not None:
                return message
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ChannelTimeoutError(f"no message within {timeout}s")
            events = self._poller.poll(max(1, math.ceil(remaining * 1000)))
            if self._gate is not None and any(sock is not self._socket for sock, _ in events):
                self._gate.service()

    def _receive_now(self, handle: Callable[[list[zmq.Frame]], Message | None]) -> Message | None:
        """The first message ``handle`` accepts among those waiting now, or None: no wait,
        no deadline and no exception, for the drains that run after every wake."""
        socket = self._socket
        # Look before reading: an empty queue costs no zmq exception. Frames waiting are
        # finite (the HWM bounds them), so a run of dropped ones ends.
        while cast(int, socket.getsockopt(_EVENTS)) & _POLLIN:
            frame = socket.recv(_NOBLOCK, copy=False)
            frames = [frame]
            while frame.more:  # read off the frame: getsockopt costs an enum per call
                frame = socket.recv(_NOBLOCK, copy=False)
                frames.append(frame)
            message = handle(frames)
            if message is not None:
                return message
        return None

    @property
    def signal_fd(self) -> int:
        """zmq's signal descriptor of this link's socket (``ZMQ_FD``): readable when the
        socket's state may have changed (see :meth:`wait_shared`)."""
        return self._signal_fd

    def has_input(self) -> bool:
        """Whether a frame waits on the socket now (it may still be dropped when read)."""
        return bool(cast(int, self._socket.getsockopt(_EVENTS)) & _POLLIN)

    def wait_shared(
        self, timeout: float, fds: Sequence[int] = (), signal: bool = True
    ) -> list[int]:
        """Block until zmq signals this link (unless not ``signal``), one of ``fds`` is
        readable, or ``timeout`` passes; return the readable ones of ``fds``.

        Unlike :meth:`wait` it never touches the socket (it sleeps on zmq's signal
        descriptor, :attr:`signal_fd`), so other threads may use the link meanwhile, one at
        a time under the owner's lock. The signal fires on a change, not while frames wait:
        after every wake the waiter reads with ``recv_now()`` until it returns None, and
        whoever else uses the link checks :meth:`has_input` afterwards and wakes the waiter
        if it is true.
        """
        self._check_open()
        deadline = deadline_after(timeout)
        poller_key = (-1 if signal else -2, *fds)
        poller = self._wait_pollers.get(poller_key)
        if poller is None:
            # Only descriptors, unless a gate's sockets are in it: the system's poll then,
            # which costs less a wake than zmq's (a loop in Python over its items).
            poller = zmq.Poller() if self._gate is not None else select.poll()
            if signal:
                poller.register(self._signal_fd, zmq.POLLIN)
            for fd in fds:
                poller.register(fd, zmq.POLLIN)
            for sock in self._gate.sockets if self._gate is not None else ():
                poller.register(sock, zmq.POLLIN)
            self._wait_pollers[poller_key] = poller
        while True:
            events = dict(poller.poll(math.ceil(max(0.0, deadline - time.monotonic()) * 1000)))
            signalled = [key for key in events if isinstance(key, int)]
            if self._gate is not None and len(signalled) < len(events):
                self._gate.service()
            # Woken only by the gate: the caller's wait is not over.
            if signalled or not events or time.monotonic() >= deadline:
                return [fd for fd in fds if events.get(fd)]

    @property
    def limits(self) -> Limits:
        """The limits this link enforces."""
        return self._limits

    def wait(self, timeout: float, fds: Sequence[int] = ()) -> tuple[bool, list[int]]:
        """Block (in zmq poll, no spinning) until a frame waits on this link, one of ``fds``
        (plain file descriptors: an eventfd, a pipe) is readable, or ``timeout`` passes.

        Returns ``(frames_waiting, readable_fds)``. A waiting frame may still be dropped: read
        with ``recv_now()`` until it returns None. This lets one thread
        own a link and also wake for work of its own, since a link is not thread-safe.
        """
        self._check_open()
        deadline = deadline_after(timeout)
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
