"""The hub's listener, shared by its pump thread and the callers (:class:`SharedListener`).

A call to a rank on another machine should cross no thread of the driver's: the caller
sends it to every member itself, and while it waits it reads the replies itself. A zmq
socket is not thread-safe, so every use of the listener holds one lock, and no thread
sleeps in a zmq poll of the socket: each sleeps on zmq's signal descriptor instead
(:meth:`~._link_end.LinkEnd.wait_shared`). That signal fires on a change, not while frames
wait, so whoever sends checks afterwards whether a frame waits, and if so wakes both the
pump and a waiting caller.

The pump still handles everything but replies (heartbeats, deaths, probes, late joins; a
caller hands over what it read of those), and sends what callers queued. But while callers
use the link (one did within :data:`CALLER_HOLD_S`), the pump leaves the link's signal to
them and looks only that often: two threads woken by every reply fight for the same two
cores and the same interpreter lock, and the reply waits.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from ._doorbell import Doorbell
from ._hub_member import Member
from ._link import ChannelError, Message, PeerId
from ._listener import Listener

__all__ = ["CALLER_HOLD_S", "SharedListener"]

#: How long after a caller last used the link the pump leaves the link's signal to callers
#: (and how often it looks meanwhile).
CALLER_HOLD_S = 0.01

#: A message for the pump to send: to the members named, or (None) to every live one.
Queued = tuple[Sequence[Member] | None, Sequence[bytes]]


class SharedListener:
    """The listener, its lock, and what the pump is to send or handle.

    ``wake`` wakes the pump; ``reply_bell`` wakes a caller waiting for replies; ``timeout``
    bounds the pump's sends (a member's full queue).
    """

    def __init__(
        self, listener: Listener, timeout: float, wake: Doorbell, reply_bell: Doorbell
    ) -> None:
        self.listener = listener
        self._timeout = timeout
        self._wake = wake
        self._reply_bell = reply_bell
        self._lock = threading.Lock()
        #: Messages for the pump to send, in order.
        self._outbox: collections.deque[Queued] = collections.deque()
        #: Messages for one member each (probes, ends), sent after the queued ones.
        self._directed: collections.deque[tuple[Member, Sequence[bytes]]] = collections.deque()
        #: Messages a caller read that are the pump's to handle, in order.
        self._handed: collections.deque[Message] = collections.deque()
        self._caller_at = 0.0
        #: Set once the pump runs: callers send and read themselves from then on.
        self.started = False

    @property
    def signal_fd(self) -> int:
        """What a caller waiting for replies polls besides its doorbell."""
        return self.listener.signal_fd

    def held(self, now: float) -> bool:
        """Whether a caller used the link within :data:`CALLER_HOLD_S` of ``now``."""
        return now - self._caller_at < CALLER_HOLD_S

    # --- callers ---------------------------------------------------------------------------

    def send_call(self, live: Sequence[Member], message: Sequence[bytes]) -> None:
        """Send a caller's call to the ``live`` members now, without waiting. It is queued
        for the pump instead, for every member if the pump is not running or has messages
        queued (the order of calls is kept), and for each member whose queue is full or whose
        link failed (the pump waits for room, or finds the member lost)."""
        late: list[Member] = []
        with self._lock:
            self._caller_at = time.monotonic()
            if self._outbox or not self.started:
                self._queue((None, message))
                return
            listener = self.listener
            for node in live:
                try:
                    listener.send(node.peer, message, timeout=0)
                except ChannelError:
                    late.append(node)
            if late:
                self._queue((late, message))
            self._after_send()

    def read_for_caller(self) -> list[Message]:
        """A caller's read: what waits on the link. If the pump is using the link, this
        waits for it at most :data:`CALLER_HOLD_S` (and returns nothing then: the pump
        hands on what it reads through the doorbell), so that a caller whose wake came from
        the link's signal never spins on it."""
        if not self.started or not self._lock.acquire(timeout=CALLER_HOLD_S):
            return []
        try:
            self._caller_at = time.monotonic()
            return self._drain()
        finally:
            self._lock.release()

    def hand_over(self, messages: Sequence[Message]) -> None:
        """Messages a caller read that are not replies: the pump handles them."""
        self._handed.extend(messages)
        self._wake.ring()

    def send_later(self, messages: Iterable[tuple[Member, Sequence[bytes]]]) -> None:
        """Messages for one member each (probes, ends), for the pump to send (any thread)."""
        self._directed.extend(messages)
        self._wake.ring()

    def queue(self, message: Sequence[bytes]) -> None:
        """Queue a message for every member behind the calls sent so far (any thread)."""
        with self._lock:
            self._queue((None, message))

    def stop(self) -> None:
        """From now on callers neither send nor read (the hub is stopping)."""
        with self._lock:
            self.started = False

    # --- the pump, and the starting thread before it -----------------------------------------

    def flush(self, live: Callable[[], list[Member]]) -> list[tuple[Member, ChannelError]]:
        """Send the queued messages (popped and sent under the lock: no caller's call
        overtakes them), then those for one member each; the members whose link failed."""
        failed: list[tuple[Member, ChannelError]] = []
        with self._lock:
            outbox = self._outbox
            while outbox:
                nodes, message = outbox.popleft()
                for node in live() if nodes is None else nodes:
                    self._send_locked(node, message, failed)
            directed = self._directed
            while directed:
                node, message = directed.popleft()
                self._send_locked(node, message, failed)
            self._after_send()
        return failed

    def send(self, node: Member, parts: Sequence[bytes]) -> ChannelError | None:
        """Send to one member (waiting up to the timeout for room); the error if it failed."""
        failed: list[tuple[Member, ChannelError]] = []
        with self._lock:
            self._send_locked(node, parts, failed)
            self._after_send()
        return failed[0][1] if failed else None

    def send_to(self, peer: PeerId, parts: Sequence[bytes], timeout: float) -> None:
        """Send to a session (a member not joined yet, say); raises :class:`ChannelError`."""
        with self._lock:
            self.listener.send(peer, parts, timeout=timeout)
            self._after_send()

    def read(self) -> list[Message]:
        """The pump's read: what a caller handed over, then what waits on the link."""
        handed = self._handed
        messages: list[Message] = []
        with self._lock:
            while handed:  # read before what waits now
                messages.append(handed.popleft())
            messages += self._drain()
        return messages

    # --- under the lock ------------------------------------------------------------------------

    def _queue(self, queued: Queued) -> None:
        self._outbox.append(queued)
        self._wake.ring()

    def _send_locked(
        self, node: Member, parts: Sequence[bytes], failed: list[tuple[Member, ChannelError]]
    ) -> None:
        if node.lost or any(gone is node for gone, _ in failed):
            return
        try:
            self.listener.send(node.peer, parts, timeout=self._timeout)
        except ChannelError as exc:
            failed.append((node, exc))

    def _drain(self) -> list[Message]:
        messages: list[Message] = []
        recv_now = self.listener.recv_now
        while (message := recv_now()) is not None:
            messages.append(message)
        return messages

    def _after_send(self) -> None:
        # zmq may have consumed the signal of a frame that came meanwhile: wake whoever waits.
        if self.listener.has_input():
            self._wake.ring()
            self._reply_bell.ring()
