"""A hub: the driver's links to the members that run ranks on other machines.

Members (an ``executor node`` agent for a node's ranks, say) dial the hub's listener, join
under an index and get a spec of what to run; one the hub cannot admit (its index taken, out
of range or not awaited, another version: :func:`_refusal`) is refused at once with the
reason. Then a caller sends its call to every member itself (:meth:`Hub.broadcast`) and reads
the replies itself while it waits (:meth:`Hub.read_replies`), and the pump thread (the
``_pump`` methods) does the rest: heartbeats both ways, members lost to silence or a failed
send, their reports (a worker died, a start failed, a probe's answer, a goodbye), late joins,
what callers could not send at once, and replies when no caller reads them (through
:attr:`Hub.inbox` and a doorbell). :class:`Member` is what the hub knows of a joined member;
:class:`Probes` matches the answers of the liveness probes (the hang bound's
``Transport.probe``) to their question; a member that does not answer in time counts all the
ranks it was asked about as silent.

The listener is shared by the pump and the callers (:class:`SharedListener`): a call to a
rank on another machine crosses no thread of the driver's. A zmq socket is not thread-safe,
so every use holds one lock, and no thread sleeps in a zmq poll of the socket: each sleeps on
zmq's signal descriptor (:meth:`~.link.LinkEnd.wait_shared`), which fires on a change, not
while frames wait; so whoever sends checks afterwards whether a frame waits, and if so wakes
both the pump and a waiting caller. While callers use the link (one did within
:data:`CALLER_HOLD_S`), the pump leaves its signal to them and looks only that often: two
threads woken by every reply fight for the same two cores and interpreter lock. The row that
keeps the callers' reads: ``executor bench --workloads nodes``, ``2 nodes: no-op`` (already
about 2x vLLM's remote reader there; a hand-off through the pump adds a wake-up to it).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import attrs

from executor_core import ExecutorError, ExecutorFailedError, WorkerDiedError

from .._shm.doorbell import Doorbell
from .._shm.node_rings import Reply, decode_reply
from .hub_protocol import Op, Refusal, call_message
from .link import ChannelError, ChannelTimeoutError, Message, PeerId
from .listener import Listener

__all__ = [
    "CALLER_HOLD_S",
    "STARTUP_SILENCE_S",
    "FailureCallback",
    "Hub",
    "Member",
    "Probes",
    "SharedListener",
    "died_on",
    "is_reply",
]


@attrs.define
class Member:
    """A joined member, as the hub sees it."""

    #: The index it joined under (a node rank, or a rank for a member serving one).
    node_rank: int
    hostname: str
    pid: int
    peer: PeerId
    #: The node's name: as the member stated it (``JOIN``'s ``node_id``), else its
    #: hostname, until :meth:`Hub.send_spec` gives the backend's.
    node_id: str = ""
    #: The member's address as it stated it (``JOIN``'s ``address``; "" if it gave none).
    address: str = ""
    #: A TCP port the member found free on its address (``JOIN``'s ``port``; 0 if none):
    #: where a rendezvous hosted on its machine may listen.
    port: int = 0
    ranks: tuple[int, ...] = ()
    last_seen: float = 0.0
    #: Its workers have stopped (it said BYE).
    done: bool = False
    lost: bool = False

    @classmethod
    def joined(cls, info: dict[str, Any], peer: PeerId) -> Member:
        """The member whose admitted ``JOIN`` said ``info``."""
        hostname = str(info["hostname"])
        return cls(
            int(info["node_rank"]),
            hostname,
            int(info["pid"]),
            peer,
            node_id=str(info.get("node_id") or hostname),
            address=str(info.get("address", "")),
            port=int(info.get("port", 0)),
        )

    def describe(self) -> str:
        """How errors name it: ``node-a at 10.0.0.5 (node rank 1, member pid 4242)``."""
        where = f" at {self.address}" if self.address else ""
        return f"{self.node_id}{where} (node rank {self.node_rank}, member pid {self.pid})"


def died_on(node: Member, info: dict[str, Any]) -> WorkerDiedError:
    """The error for ``info``, a ``DIED`` report of ``node``: which rank died there, and how."""
    rank = info.get("rank")
    code = info.get("exitcode")
    detail = f"on node {node.node_id}"
    if info.get("parent_died"):
        detail += ", it saw its node's member process die"
    if not isinstance(rank, int):
        rank = min(node.ranks, default=-1)
    if isinstance(code, int) and code < 0:
        return WorkerDiedError(rank, signal=-code, detail=detail, node=node.node_id)
    return WorkerDiedError(
        rank, exitcode=code if isinstance(code, int) else None, detail=detail, node=node.node_id
    )


#: What an answer may take beyond the members' own wait (the link, the member's loop).
_ANSWER_SLACK_S = 0.5


class Probes:
    """Questions in flight, by token, and their answers."""

    def __init__(self) -> None:
        self._tokens = itertools.count(1)
        self._cond = threading.Condition()
        #: token -> {node rank: its answer}, filled by :meth:`answer`.
        self._answers: dict[int, dict[int, dict[str, Any]]] = {}

    def ask(
        self, nodes: Iterable[Member], ranks: Sequence[int], timeout: float, port: bool = False
    ) -> tuple[int, list[tuple[Member, list[bytes]]]]:
        """A token and the ``PROBE`` message for each member holding some of ``ranks`` (with
        ``port``: for each of ``nodes``, which also names a free port in its answer)."""
        token = next(self._tokens)
        with self._cond:
            self._answers[token] = {}
        messages = []
        for node in nodes:
            asked = [rank for rank in ranks if rank in node.ranks]
            if asked or port:
                payload = {"token": token, "ranks": asked, "timeout_s": timeout, "port": port}
                messages.append((node, Op.frame(Op.PROBE, payload)))
        return token, messages

    def answer(self, node: Member, info: dict[str, Any]) -> None:
        """The pump: ``node``'s ``PROBED``."""
        token, silent = info.get("token"), info.get("silent")
        if not isinstance(token, int) or not isinstance(silent, list):
            return
        with self._cond:
            answers = self._answers.get(token)
            if answers is not None:
                answers[node.node_rank] = info | {"silent": [r for r in silent if r in node.ranks]}
                self._cond.notify_all()

    def answers(self, token: int, asked: int, timeout: float) -> dict[int, dict[str, Any]]:
        """The answers to ``token`` by node rank, once ``asked`` members answered or
        ``timeout`` (plus slack) passed."""
        deadline = time.monotonic() + timeout + _ANSWER_SLACK_S
        with self._cond:
            answers = self._answers[token]
            while len(answers) < asked:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return self._answers.pop(token)

    def wait(
        self, token: int, asked: Sequence[Member], ranks: Sequence[int], timeout: float
    ) -> set[int]:
        """The ranks among ``ranks`` that ``asked`` reported silent, or that a member which
        did not answer within ``timeout`` (plus slack) holds."""
        answers = self.answers(token, len(asked), timeout)
        silent = {rank for answer in answers.values() for rank in answer["silent"]}
        for node in asked:
            if node.node_rank not in answers:
                silent.update(rank for rank in ranks if rank in node.ranks)
        return silent


def _refusal(
    info: dict[str, Any],
    *,
    version: str,
    terms: Mapping[str, Any],
    node_ranks: AbstractSet[int],
    awaited: AbstractSet[int],
    nodes: Sequence[Member],
    ready: bool,
) -> tuple[Refusal, str] | None:
    """Why the member that sent ``info`` (its ``JOIN``) cannot be admitted now; None if it can.

    The hub's admission state: its ``version``, the ``terms`` of its job, the job's
    ``node_ranks``, those ``awaited`` now, the ``nodes`` that joined so far, and whether every
    rank is ``ready``.
    """
    rank = info.get("node_rank")
    hostname, pid, expects = info.get("hostname"), info.get("pid"), info.get("expects", {})
    if (
        type(rank) is not int
        or not isinstance(hostname, str)
        or type(pid) is not int
        or not isinstance(expects, dict)
        or not isinstance(info.get("node_id", ""), str)
        or not isinstance(info.get("address", ""), str)
        or type(info.get("port", 0)) is not int
    ):
        shown = repr(info)
        shown = shown if len(shown) <= 200 else shown[:200] + "..."
        return Refusal.MALFORMED, f"a malformed join request {shown}"
    if info.get("version") != version:
        return Refusal.VERSION, (
            f"node rank {rank} runs version {info.get('version')}, the driver "
            f"{version}: install the same versions on every node"
        )
    differ = {key: value for key, value in expects.items() if key in terms and terms[key] != value}
    if differ:
        theirs = ", ".join(f"{key}={value!r}" for key, value in differ.items())
        ours = ", ".join(f"{key}={terms[key]!r}" for key in differ)
        return Refusal.MISMATCH, (
            f"node rank {rank} was started for {theirs}, and this executor has {ours}"
        )
    if rank not in node_ranks:
        job = ", ".join(f"{key}={value!r}" for key, value in terms.items())
        return Refusal.OUT_OF_RANGE, (
            f"node rank {rank} is out of range: this executor's members have node rank(s) "
            f"{_ranks_text(node_ranks)}" + (f" ({job})" if job else "")
        )
    if rank in awaited:
        return None
    holder = next((n for n in nodes if n.node_rank == rank and not n.lost and not n.done), None)
    if holder is not None:
        if awaited:
            state = f"the executor still awaits node rank(s) {_ranks_text(awaited)}"
        elif ready:
            state = "the executor is running and awaits no member"
        else:
            state = "the executor is starting its workers and awaits no member"
        return Refusal.TAKEN, (
            f"node rank {rank} has joined already (member pid {holder.pid} on "
            f"{holder.hostname}); {state}"
        )
    gone = next((n for n in nodes if n.node_rank == rank), None)
    if gone is not None and gone.done:
        why = "its member has stopped its workers: the executor is shutting down"
    elif gone is not None:
        why = "its member was lost, and the executor awaits no other member for it"
    else:
        why = "the executor awaits no member for it"
    return Refusal.NOT_AWAITED, f"node rank {rank} is not awaited: {why}"


def _ranks_text(ranks: Iterable[int]) -> str:
    """``1 to 3`` for a run of ranks, else ``[1, 4]``."""
    ordered = sorted(ranks)
    if len(ordered) == 1:
        return str(ordered[0])
    if ordered and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]} to {ordered[-1]}"
    return str(ordered)


def _refused(refusal: Refusal, reason: str, awaited: Iterable[int]) -> list[bytes]:
    """The ``REFUSED`` answer: the reason, the refusal and the node ranks awaited now."""
    payload = {"reason": reason, "refusal": refusal.value, "awaited": sorted(awaited)}
    return Op.frame(Op.REFUSED, payload)


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
        """Send the messages for one member each (an ``END`` precedes the ``REPLACE`` of a
        recovery that followed it), then the queued ones (popped and sent under the lock: no
        caller's call overtakes them); the members whose link failed."""
        failed: list[tuple[Member, ChannelError]] = []
        with self._lock:
            directed = self._directed
            while directed:
                node, message = directed.popleft()
                self._send_locked(node, message, failed)
            outbox = self._outbox
            while outbox:
                nodes, message = outbox.popleft()
                for node in live() if nodes is None else nodes:
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


logger = logging.getLogger("executor_channel")

#: Seconds of silence that lose a node (or, for a member, the driver) while workers start.
STARTUP_SILENCE_S = 10.0

#: Called from the pump thread with the error that fails the executor.
FailureCallback = Callable[[ExecutorFailedError], None]


def is_reply(message: Message) -> bool:
    """Whether ``message`` is a reply frame (``FRAME`` and its payload)."""
    chunks = message.chunks
    return len(chunks) == 2 and b"".join(chunks[0]) == Op.FRAME


logger = logging.getLogger("executor_channel")


class Hub:
    """The listener, the joined members and the pump thread."""

    #: Seconds of silence that lose a node (or, for a member, the driver) while workers
    #: start.
    STARTUP_SILENCE_S = STARTUP_SILENCE_S

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
        #: Members admitted after the start for a lost node (see :meth:`rejoined`), by node
        #: rank, until :meth:`send_spec` puts each in :attr:`nodes` in its lost one's place.
        self._late: dict[int, Member] = {}
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
        :class:`~.hub_protocol.Refusal`): during this wait, and afterwards by the pump.

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
            if message.parts and bytes(message.parts[0]) == Op.JOIN:
                self._on_join(message)
            # anything else: a stray message of a member from an earlier run
        self.nodes.sort(key=lambda node: node.node_rank)
        return list(self.nodes)

    @property
    def awaited(self) -> frozenset[int]:
        """The node ranks whose member is awaited now: a member joining for one of them is
        admitted, any other is refused. Empty once :meth:`join` has returned, until a node is
        lost after the start (:meth:`lose`): its node rank is awaited again."""
        return frozenset(self._awaited)

    def rejoined(
        self, node_rank: int, timeout: float, check: Callable[[], None] = lambda: None
    ) -> Member | None:
        """The member admitted for ``node_rank``, a node lost after the start, once one has
        joined again (within ``timeout``; None if none did). ``check()`` runs about once a
        second meanwhile and raises if none can come. The member waits for its spec
        (:meth:`send_spec`); until then it is sent nothing else."""
        deadline, next_check = time.monotonic() + timeout, 0.0
        while (member := self._late.get(node_rank)) is None:
            now = time.monotonic()
            if now >= deadline or self._thread is None:
                return None
            if now >= next_check:
                check()
                next_check = now + 1.0
            time.sleep(0.05)
        return member

    def _on_join(self, message: Message) -> Member | None:
        """Admit the member that sent this ``JOIN``, or refuse it at once (whoever owns the
        listener: the starting thread in :meth:`join`, then the pump)."""
        if message.peer in self._by_peer:
            return None  # a member joins once; a second JOIN of its session changes nothing
        info = Op.read(message.parts)
        refused = _refusal(
            info,
            version=self._version,
            terms=self._terms,
            node_ranks=self._node_ranks,
            awaited=self._awaited,
            nodes=[*self.nodes, *self._late.values()],
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
            answer = _refused(refusal, reason, self._awaited)
            with contextlib.suppress(ChannelError):
                self._link.send_to(message.peer, answer, timeout=0)
            return None
        node = Member.joined(info, message.peer)
        self._awaited.discard(node.node_rank)
        if self._thread is None:
            self.nodes.append(node)
        else:  # for a lost node: its spec comes from the recovery (rejoined)
            logger.info("node rank %d: a member joined again (pid %d)", node.node_rank, node.pid)
            self._late[node.node_rank] = node
        self._by_peer[message.peer] = node
        return node

    def send_spec(self, member: Member, node_id: str, ranks: Sequence[int], spec: bytes) -> None:
        """Send a joined member what it runs: before :meth:`start`, or to a member that
        joined again for a lost node (:meth:`rejoined`), which then takes that node's place.
        ``spec`` is the backend's (pickled, say); ``ranks`` are the ranks whose replies it
        may send."""
        member.node_id = node_id
        member.ranks = tuple(ranks)
        self._send_now(member.peer, [Op.SPEC, spec])
        if self._late.get(member.node_rank) is member:
            # Starting its workers, it may be silent as long as at the start.
            member.last_seen = time.monotonic() + max(0.0, STARTUP_SILENCE_S - self._timeout)
            at = next(i for i, n in enumerate(self.nodes) if n.node_rank == member.node_rank)
            self.nodes[at] = member
            del self._late[member.node_rank]

    def announce(self, member: Member) -> None:
        """Tell ``member``, which took a lost node's place, that its ranks are ready."""
        self._link.send_later([(member, [Op.READY])])

    def fresh_port(self, member: Member, timeout: float) -> int:
        """A TCP port that ``member`` found free on its address, asked now (a new
        rendezvous hosted on its machine); 0 if it did not answer within ``timeout``."""
        token, messages = self._probes.ask([member], [], timeout, port=True)
        self._link.send_later(messages)
        port = self._probes.answers(token, 1, timeout).get(member.node_rank, {}).get("port")
        return port if type(port) is int else 0

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
        self._link.send_call(self._live(), call_message(parts))

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
                messages.append((node, Op.frame(Op.END, {"ranks": held})))
        self._link.send_later(messages)

    def replace(self, ranks: Sequence[int], launches: bytes) -> None:
        """Have the members holding ``ranks`` start new processes for them (``REPLACE``,
        queued in order with the calls: it follows every call sent before, and precedes
        every call sent after). ``launches`` is the backend's bytes for those ranks."""
        payload = Op.frame(Op.REPLACE, {"ranks": list(ranks)})
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
                    self._send(node, [Op.READY])
                announced = True
            if now >= next_ping:
                for node in self._live():
                    self._send(node, [Op.PING])
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
                if op == Op.JOIN:  # a late or duplicate member: it is told why at once
                    self._on_join(message)
                continue
            if is_reply(message):
                got_reply |= self._take_reply(node, message)
                continue
            if node.lost:
                continue
            node.last_seen = time.monotonic()
            if op == Op.DIED:
                info = Op.read(message.parts)
                if not info.get("ended"):  # ended by END: its calls failed already
                    self._on_failure(died_on(node, info))
            elif op == Op.FAILED:
                info = Op.read(message.parts)
                reason = str(info.get("reason", "?"))
                if info.get("started"):  # its workers were running: they are gone
                    self.lose(node, f"node {node.describe()}: {reason}")
                else:
                    node.lost = True
                    self._on_failure(ExecutorFailedError(f"node {node.describe()}: {reason}"))
            elif op == Op.PROBED:
                self._probes.answer(node, Op.read(message.parts))
            elif op == Op.BYE:
                node.done = True
        if got_reply:
            self._reply_bell.ring()

    def lose(self, node: Member, why: str) -> None:
        """``node`` is gone (``why``): its ranks' calls fail, once. Any thread."""
        if node.lost or node.done:
            return
        node.lost = True
        if self._thread is not None and not self._stopped:  # a member may join in its place
            self._awaited.add(node.node_rank)
        first = min(node.ranks, default=-1)
        self._on_failure(WorkerDiedError(first, detail=why, ranks=node.ranks, node=node.node_id))

    def _kill_all(self, rejoin: bool = False) -> None:
        """Tell every member not done yet to stop its workers now (best effort); with
        ``rejoin``, to join again afterwards."""
        message = Op.frame(Op.KILL, {"rejoin": True}) if rejoin else [Op.KILL]
        for node in [*self.nodes, *self._late.values()]:
            if not node.lost and not node.done:
                with contextlib.suppress(ChannelError):
                    self._link.send_to(node.peer, message, timeout=0.1)
