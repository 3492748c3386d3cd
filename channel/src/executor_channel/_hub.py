"""A hub: the driver's links to the members that run ranks on other machines.

Members (an ``executor node`` agent for a node's ranks, say) dial the hub's listener, join
under an index, and get a spec of what to run; one the hub cannot admit (its index taken,
out of range or not awaited, another version) is refused at once with the reason, during
start-up and while the pump runs. Then a caller sends its call to every member itself
(:meth:`Hub.broadcast`) and reads the replies itself while it waits (:meth:`Hub.read_replies`,
from the backend's poll), and one thread (the hub's pump) does the rest: it exchanges
heartbeats, reports a member that stops answering or a worker that died there, sends what
could not go at once, and hands the replies it reads to the backend's poll (through
:attr:`Hub.inbox` and a doorbell). How the two share the listener is
:mod:`._hub_link`'s to say.

Whom the hub admits is :mod:`._hub_admission`'s to say; what it records of a member, in
:mod:`._hub_member`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from executor_core import ExecutorError

from . import _hub_admission as admission
from . import _hub_protocol as wire
from ._doorbell import Doorbell
from ._hub_link import SharedListener
from ._hub_member import Member
from ._hub_probes import Probes
from ._hub_pump import STARTUP_SILENCE_S, FailureCallback, Pump, is_reply
from ._link import ChannelError, ChannelTimeoutError, Message, PeerId
from ._listener import Listener
from ._node_rings import Reply

__all__ = ["STARTUP_SILENCE_S", "Hub", "Member"]

logger = logging.getLogger("executor_channel")


class Hub(Pump):
    """The listener, the joined members and the pump thread."""

    def __init__(
        self,
        listener: Listener,
        node_timeout_s: float,
        reply_bell: Doorbell,
        on_failure: FailureCallback,
    ) -> None:
        self._listener = listener
        self._timeout = node_timeout_s
        self._interval = node_timeout_s / 4
        self._reply_bell = reply_bell
        self._on_failure = on_failure
        self.nodes: list[Member] = []
        self._by_peer: dict[PeerId, Member] = {}
        # The admission state (see join): the job's node ranks and those awaited now.
        self._node_ranks: frozenset[int] = frozenset()
        self._awaited: set[int] = set()
        self._version = ""
        self._terms: dict[str, Any] = {}
        #: Replies (and ready frames) from the members, for the transport's poll.
        self.inbox: collections.deque[Reply] = collections.deque()
        self._probes = Probes()
        self._wake = Doorbell()
        self._link = SharedListener(listener, node_timeout_s, self._wake, reply_bell)
        self._wake_closed = False
        self._stopped = False
        self._stop = threading.Event()
        #: Set by the transport once every rank is ready: from then on ``node_timeout_s``
        #: of silence loses a node.
        self.ready = False
        self._thread: threading.Thread | None = None

    @property
    def reply_bell(self) -> Doorbell:
        """The doorbell rung when replies wait in :attr:`inbox`."""
        return self._reply_bell

    # --- start-up (the starting thread owns the listener until start()) ------------------

    def join(
        self,
        node_ranks: Sequence[int],
        version: str,
        timeout: float,
        hint: str,
        *,
        terms: Mapping[str, Any] | None = None,
        check: Callable[[frozenset[int]], None] | None = None,
    ) -> list[Member]:
        """Wait until a member has joined for every one of ``node_ranks``, the job's node
        ranks. ``hint`` ends the error if some never join (how to start them). ``terms`` are
        facts about the job (``{"num_nodes": 3}``) that a member may say it expects.

        Whether a member is admitted depends only on the admission state: the job's node
        ranks, those awaited now (:attr:`awaited`) and the members that hold the others. A
        member that cannot be admitted is answered ``REFUSED`` at once, with the reason (a
        :class:`~._hub_protocol.Refusal`): during this wait, and afterwards by the pump.

        ``check(awaited)`` runs about once a second while members are awaited and raises if
        one of them can no longer come (the backend saw its process end, say). Returns the
        joined members in node rank order (also :attr:`nodes`).
        """
        self._node_ranks = frozenset(node_ranks)
        self._awaited = set(self._node_ranks)
        self._version = version
        self._terms = dict(terms or {})
        deadline = time.monotonic() + timeout
        listener = self._listener
        while self._awaited:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ExecutorError(
                    f"node rank(s) {sorted(self._awaited)} did not join within startup_timeout="
                    f"{timeout:g} s: {hint}"
                )
            try:
                message = listener.recv(min(remaining, 1.0))
            except ChannelTimeoutError:
                if check is not None:
                    check(frozenset(self._awaited))
                continue
            if message.parts and bytes(message.parts[0]) == wire.JOIN:
                self._on_join(message)
            # anything else: a stray message of a member from an earlier run
        self.nodes.sort(key=lambda node: node.node_rank)
        return list(self.nodes)

    @property
    def awaited(self) -> frozenset[int]:
        """The node ranks whose member is awaited now: a member joining for one of them is
        admitted, any other is refused. Empty once :meth:`join` has returned; admitting a
        member again for a lost node would mean putting its rank back here (and sending the
        new member its spec from the pump)."""
        return frozenset(self._awaited)

    def _on_join(self, message: Message) -> Member | None:
        """Admit the member that sent this ``JOIN``, or refuse it at once (whoever owns the
        listener: the starting thread in :meth:`join`, then the pump)."""
        if message.peer in self._by_peer:
            return None  # a member joins once; a second JOIN of its session changes nothing
        info = wire.read_control(message.parts)
        refused = admission.refusal(
            info,
            version=self._version,
            terms=self._terms,
            node_ranks=self._node_ranks,
            awaited=self._awaited,
            nodes=self.nodes,
            ready=self.ready,
        )
        if refused is not None:
            refusal, reason = refused
            logger.warning(
                "refused a member (pid %s on %s): %s",
                info.get("pid", "?"),
                info.get("hostname", "?"),
                reason,
            )
            # Best effort: a member gone since it asked must not stop the executor.
            answer = admission.refused(refusal, reason, self._awaited)
            with contextlib.suppress(ChannelError):
                self._link.send_to(message.peer, answer, timeout=0)
            return None
        node = Member.joined(info, message.peer)
        self._awaited.discard(node.node_rank)
        self.nodes.append(node)
        self._by_peer[message.peer] = node
        return node

    def send_spec(self, member: Member, node_id: str, ranks: Sequence[int], spec: bytes) -> None:
        """Send a joined member what it runs (before :meth:`start`): ``spec`` is the
        backend's (pickled, say); ``ranks`` are the ranks whose replies it may send."""
        member.node_id = node_id
        member.ranks = tuple(ranks)
        self._send_now(member.peer, [wire.SPEC, spec])

    def _send_now(self, peer: PeerId, parts: Sequence[bytes]) -> None:
        try:
            self._link.send_to(peer, parts, timeout=self._timeout)
        except ChannelError as exc:
            raise ExecutorError(f"could not reach a member: {exc}") from exc

    def start(self) -> None:
        """Start the pump thread; from now on callers send and read themselves too."""
        now = time.monotonic()
        for node in self.nodes:
            node.last_seen = now
        self._thread = threading.Thread(target=self._run, name="executor-hub", daemon=True)
        self._link.started = True
        self._thread.start()

    # --- any thread -------------------------------------------------------------------------

    def broadcast(self, parts: Sequence[Any]) -> None:
        """Send a call frame (the codec's parts) to every node, from this thread, without
        waiting (what cannot go at once, the pump sends; see
        :meth:`SharedListener.send_call`). What the caller could change once the call is
        sent is copied now; a large buffer of immutable ``bytes`` is kept as it is (no
        copy), between the joined runs of the other parts."""
        self._link.send_call(self._live(), wire.call(parts))

    @property
    def reply_fd(self) -> int:
        """What a caller waiting for replies polls besides :attr:`reply_bell` (then calls
        :meth:`read_replies`)."""
        return self._link.signal_fd

    def read_replies(self) -> None:
        """Read what waits from the members (see :meth:`SharedListener.read_for_caller`): the
        replies go to :attr:`inbox`, the rest to the pump. The backend's poll calls it (any
        thread)."""
        messages = self._link.read_for_caller()
        if not messages:
            return
        others = []
        for message in messages:
            node = self._by_peer.get(message.peer)
            if node is not None and is_reply(message):
                self._take_reply(node, message)
            else:
                others.append(message)
        if others:
            self._link.hand_over(others)

    def probe(self, ranks: Sequence[int], timeout: float) -> Callable[[], set[int]]:
        """Start the liveness probe of remote ``ranks`` (``PROBE``); the function returned
        waits for it: the ranks whose member said they did not answer within ``timeout``, or
        whose member did not answer in time."""
        token, messages = self._probes.ask(self._live(), ranks, timeout)
        self._link.send_later(messages)
        asked = [node for node, _ in messages]
        return functools.partial(self._probes.wait, token, asked, ranks, timeout)

    def end(self, ranks: Sequence[int]) -> None:
        """Have the members holding ``ranks`` kill those workers now (``END``)."""
        messages = []
        for node in self._live():
            held = [rank for rank in ranks if rank in node.ranks]
            if held:
                messages.append((node, wire.control(wire.END, {"ranks": held})))
        self._link.send_later(messages)

    def replace(self, ranks: Sequence[int], launches: bytes) -> None:
        """Have the members holding ``ranks`` start new processes for them (``REPLACE``,
        queued in order with the calls: it follows every call sent before, and precedes
        every call sent after). ``launches`` is the backend's bytes for those ranks."""
        payload = wire.control(wire.REPLACE, {"ranks": list(ranks)})
        self._link.queue([*payload, launches])

    def wake(self) -> None:
        """Make the pump look at its state now (``ready`` was set)."""
        self._wake.ring()

    def stop(self, graceful: bool, grace_s: float, rejoin: bool = False) -> None:
        """Stop the pump: gracefully, once every member said its workers stopped (at most
        ``grace_s``; the stop frame must be queued already), else at once with KILL. With
        ``rejoin``, the KILL asks each member to stop its workers and join again (the
        executor restarts its workers: a recovery)."""
        thread, self._thread = self._thread, None
        self._link.stop()
        if thread is None:  # not started (start-up failed: release who joined), or stopped
            if not self._stopped:
                self._kill_all(rejoin)
            self._stopped = True
            self._close_wake()
            return
        if graceful:
            deadline = time.monotonic() + grace_s
            while not all(n.done or n.lost for n in self.nodes) and thread.is_alive():
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.01)
        self._stop.set()
        self._wake.ring()
        thread.join(10.0)
        if not thread.is_alive():  # the listener is this thread's now
            self._kill_all(rejoin)
        self._stopped = True
        self._close_wake()

    def _close_wake(self) -> None:
        if not self._wake_closed:
            self._wake_closed = True
            self._wake.close()
