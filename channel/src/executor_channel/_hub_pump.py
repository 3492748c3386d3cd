"""The hub's pump thread (:class:`Pump`, a part of :class:`~._hub.Hub`): heartbeats both
ways, members lost to silence or a failed send, the members' reports (a worker died, a start
failed, a probe's answer, a goodbye), late joins, and what callers could not send at once.
It reads replies too when no caller is reading them (see :mod:`._hub_link`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence

from executor_core import ExecutorFailedError, WorkerDiedError

from . import _hub_protocol as wire
from ._doorbell import Doorbell
from ._hub_link import CALLER_HOLD_S, SharedListener
from ._hub_member import Member, died_on
from ._hub_probes import Probes
from ._link import ChannelError, Message, PeerId
from ._listener import Listener
from ._node_rings import Reply, decode_reply

__all__ = ["STARTUP_SILENCE_S", "FailureCallback", "Pump", "is_reply"]

logger = logging.getLogger("executor_channel")

#: Seconds of silence that lose a node (or, for a member, the driver) while workers start.
STARTUP_SILENCE_S = 10.0

#: Called from the pump thread with the error that fails the executor.
FailureCallback = Callable[[ExecutorFailedError], None]


class Pump:
    """The pump thread's half of the hub (the hub sets these attributes up)."""

    nodes: list[Member]
    inbox: collections.deque[Reply]
    ready: bool
    _by_peer: dict[PeerId, Member]
    _link: SharedListener
    _listener: Listener
    _wake: Doorbell
    _reply_bell: Doorbell
    _stop: threading.Event
    _probes: Probes
    _timeout: float
    _interval: float
    _on_failure: FailureCallback

    def _on_join(self, message: Message) -> Member | None:
        raise NotImplementedError  # the hub's: admitting a member

    def _run(self) -> None:
        try:
            self._pump()
        except Exception as exc:
            logger.exception("the hub's links to its members failed")
            self._on_failure(ExecutorFailedError(f"the links to the other nodes failed: {exc}"))

    def _pump(self) -> None:
        link = self._link
        listener = self._listener
        fds = [self._wake.fd]
        next_ping = 0.0
        announced = False
        while not self._stop.is_set():
            now = time.monotonic()
            timeout = max(0.0, min(next_ping - now, self._interval))
            # While callers read the link, the pump only looks now and then (see _hub_link).
            held = link.held(now)
            if listener.wait_shared(
                min(timeout, CALLER_HOLD_S) if held else timeout, fds, not held
            ):
                self._wake.clear()
            self._flush()
            self._receive()
            now = time.monotonic()
            if self.ready and not announced:
                for node in self._live():
                    self._send(node, [wire.READY])
                announced = True
            if now >= next_ping:
                for node in self._live():
                    self._send(node, [wire.PING])
                next_ping = now + self._interval
            # Until every rank is ready, machines are busy starting workers (imports, model
            # loads): a silence is waited out longer, but not for ever.
            limit = self._timeout if self.ready else max(self._timeout, STARTUP_SILENCE_S)
            for node in self._live():
                if now - node.last_seen > limit:
                    self.lose(
                        node,
                        f"node {node.describe()} sent nothing for {now - node.last_seen:.1f} s: "
                        "its member process or its machine is gone",
                    )

    def _live(self) -> list[Member]:
        return [node for node in self.nodes if not node.lost]

    def _flush(self) -> None:
        for node, exc in self._link.flush(self._live):
            self.lose(node, f"sending to node {node.describe()} failed: {exc}")

    def _send(self, node: Member, parts: Sequence[bytes]) -> None:
        exc = self._link.send(node, parts)
        if exc is not None:
            self.lose(node, f"sending to node {node.describe()} failed: {exc}")

    def _take_reply(self, node: Member, message: Message) -> bool:
        """Put the reply ``message`` of ``node`` in the inbox; False if it was dropped."""
        if node.lost:
            return False
        node.last_seen = time.monotonic()
        reply = decode_reply(message.parts[1])
        if reply[2] not in node.ranks:
            logger.warning("%s sent a reply of rank %d, not its own", node.describe(), reply[2])
            return False
        self.inbox.append(reply)
        return True

    def _receive(self) -> None:
        got_reply = False
        for message in self._link.read():
            if not message.parts:
                continue
            op = bytes(message.parts[0])
            node = self._by_peer.get(message.peer)
            if node is None:
                if op == wire.JOIN:  # a late or duplicate member: it is told why at once
                    self._on_join(message)
                continue
            if is_reply(message):
                got_reply |= self._take_reply(node, message)
                continue
            if node.lost:
                continue
            node.last_seen = time.monotonic()
            if op == wire.DIED:
                info = wire.read_control(message.parts)
                self._on_failure(died_on(node, info))
            elif op == wire.FAILED:
                info = wire.read_control(message.parts)
                reason = str(info.get("reason", "?"))
                if info.get("started"):  # its workers were running: they are gone
                    self.lose(node, f"node {node.describe()}: {reason}")
                else:
                    node.lost = True
                    self._on_failure(ExecutorFailedError(f"node {node.describe()}: {reason}"))
            elif op == wire.PROBED:
                self._probes.answer(node, wire.read_control(message.parts))
            elif op == wire.BYE:
                node.done = True
        if got_reply:
            self._reply_bell.ring()

    def lose(self, node: Member, why: str) -> None:
        """``node`` is gone (``why``): its ranks' calls fail, once. Any thread."""
        if node.lost or node.done:
            return
        node.lost = True
        first = min(node.ranks, default=-1)
        self._on_failure(WorkerDiedError(first, detail=why, ranks=node.ranks, node=node.node_id))

    def _kill_all(self, rejoin: bool = False) -> None:
        """Tell every member not done yet to stop its workers now (best effort); with
        ``rejoin``, to join again afterwards."""
        message = wire.control(wire.KILL, {"rejoin": True}) if rejoin else [wire.KILL]
        for node in self.nodes:
            if not node.lost and not node.done:
                with contextlib.suppress(ChannelError):
                    self._link.send_to(node.peer, message, timeout=0.1)


def is_reply(message: Message) -> bool:
    """Whether ``message`` is a reply frame (``FRAME`` and its payload)."""
    chunks = message.chunks
    return len(chunks) == 2 and b"".join(chunks[0]) == wire.FRAME
