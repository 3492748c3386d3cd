"""``executor node``: the agent that runs one node's workers for a driver on another machine.

It dials the driver's hub (authenticated with the shared secret), says which node it is, and
receives its :class:`~._workers.NodeSpec`, or the driver's refusal (one line on stderr with
the reason and what to do, status 2; no driver within the join timeout: status 3). Then it
starts the node's workers on rings of its own and relays, from one thread asleep on the link
and the reply and death doorbells: each call frame is written once into the ring, each reply
frame sent back unpickled. Heartbeats go both ways: a driver silent for ``node_timeout_s``
stops the node; a dead agent's workers exit (parent-death signal, death pipe).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import pickle
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from executor_channel import (
    ChannelError,
    ChannelTimeoutError,
    Connection,
    Doorbell,
    Hub,
    Kind,
    NodeRings,
    Op,
    Received,
    Refusal,
    Secret,
)
from executor_core import ConfigError, ExecutorError
from executor_core.backend import reserve_port

from ._workers import PARENT_DIED_EXIT, NodeSpec, WorkerGroup, check_devices

__all__ = ["run_agent"]

logger = logging.getLogger("executor_plugin_multiproc.agent")

#: Exit status of an agent that found no driver, or whose driver went silent or failed.
DRIVER_LOST_EXIT = 3
#: Exit status of an agent the driver refused (or released before it started).
REFUSED_EXIT = 2
#: A session's status when the driver asked this node to join its next incarnation.
_REJOIN = -1
#: The longest liveness probe an agent runs (it holds the relay meanwhile).
_MAX_PROBE_S = 5.0

#: What an agent refused for each reason should do (the driver's reason says why).
_REMEDIES: dict[str, str] = {
    Refusal.MALFORMED: "install the same version of the executor packages on every machine",
    Refusal.VERSION: "then start this agent again",
    Refusal.MISMATCH: (
        "start this agent with --num-nodes equal to the driver's num_nodes, or without it"
    ),
    Refusal.OUT_OF_RANGE: "start it with one of those node ranks (--node-rank)",
    Refusal.TAKEN: ("each node rank takes one agent, and every one has its agent: stop this one"),
    Refusal.NOT_AWAITED: (
        "stop this agent; an agent joins a driver that is waiting for its node rank, so start "
        "it again for the next executor"
    ),
}


def run_agent(
    node_rank: int,
    master_addr: str,
    master_port: int,
    join_timeout: float,
    secret: Secret,
    num_nodes: int | None,
    node_id: str | None,
    address: str | None,
) -> int:
    """Join the driver at ``master_addr:master_port`` and serve until it stops this node
    (``executor node``'s options); the exit status. Every failure to join is one line."""
    host = f"[{master_addr}]" if ":" in master_addr else master_addr
    driver = f"tcp://{host}:{master_port}"
    if address is None:  # the local address of the route to the driver (no packet is sent)
        address = ""
        family = socket.AF_INET6 if ":" in master_addr else socket.AF_INET
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as route:
            route.connect((master_addr, master_port))
            address = str(route.getsockname()[0])
    join = {
        "node_rank": node_rank,
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "expects": {} if num_nodes is None else {"num_nodes": num_nodes},
        "node_id": node_id or socket.gethostname(),
        "address": address,
    }
    # SIGTERM (a scheduler stopping this job) ends the agent like Ctrl-C: workers stopped.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        while True:
            logger.info("node %d: joining the driver at %s", node_rank, driver)
            try:
                link = Connection(driver, secret, timeout=join_timeout)
            except ChannelTimeoutError:
                print(
                    f"executor node: no driver answered at {driver} within --join-timeout="
                    f"{join_timeout:g} s. Check that an mp executor with num_nodes > "
                    f"{node_rank} is starting there (--master-addr and --master-port are its "
                    "distributed_host and backend_options['node_port']), that this machine can "
                    "reach that port, and that both sides hold the same secret (fingerprint "
                    f"{secret.fingerprint} here; a driver refusing another secret logs a "
                    "warning with its own fingerprint).",
                    file=sys.stderr,
                )
                return DRIVER_LOST_EXIT
            except ChannelError as exc:
                print(
                    f"executor node: could not dial the driver at {driver}: {exc}", file=sys.stderr
                )
                return DRIVER_LOST_EXIT
            with link:
                status = NodeAgent(link, join_timeout, join).run()
            if status != _REJOIN:
                return status
            # The driver restarts its workers (a recovery): join its next incarnation.
            logger.info("node %d: the driver restarts its workers; joining again", node_rank)
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Killed(Exception):
    """The driver said KILL (its status the argument) while a call was being written into
    the full ring."""


class NodeAgent:
    """One session of an agent with its driver: join, start this node's workers, relay."""

    def __init__(self, link: Connection, join_timeout: float, join: dict[str, Any]) -> None:
        self._link, self._join = link, join
        self._node_rank: int = join["node_rank"]
        self._join_timeout = self._timeout = join_timeout  # node_timeout_s once the spec came
        self._death_bell = Doorbell()
        self._cleanups: list[Callable[[], None]] = [self._death_bell.close]
        self._deaths: collections.deque[tuple[int, int]] = collections.deque()
        self._group: WorkerGroup | None = None
        self._last_seen, self._last_sent = time.monotonic(), 0.0
        self._all_ready = False
        #: A worker of this node died (the exit status is then 1).
        self._lost_worker = False
        #: Indices of workers that died and are not replaced yet: they do not hold the ring.
        self._dead: set[int] = set()
        #: Indices of workers the driver ended (``END``) whose death is not reported yet.
        self._ended: set[int] = set()
        #: Call frames received and not yet written into the ring (it was full), and the
        #: driver's rank replacements (dicts), in their order.
        self._pending: collections.deque[tuple[memoryview, ...] | dict[str, Any]] = (
            collections.deque()
        )

    def run(self) -> int:
        from . import __version__

        link, node_rank = self._link, self._node_rank
        try:
            join = self._join | {"version": __version__, "port": self._free_port()}
            self._send(Op.frame(Op.JOIN, join))
            spec = self._receive_spec()
            if isinstance(spec, int):
                return spec
            options, launches = spec.options, spec.launches
            self._timeout, self._grace = options.node_timeout_s, options.shutdown_grace_s
            self._first_rank = first = launches[0].rank
            try:
                check_devices(options, spec.device, len(launches), spec.worker_env)
                self._channel = NodeRings(len(launches), options.ring_sizes, self._cleanups.append)
                self._group = WorkerGroup(
                    self._channel,
                    launches,
                    options,
                    self._cleanups.append,
                    self._on_death,
                    spec.spares,
                    spec.preload,
                )
            except (ConfigError, ExecutorError, OSError) as exc:
                reason = f"starting its workers: {exc}"
                self._send(Op.frame(Op.FAILED, {"reason": reason, "started": False}))
                return 1
            self._group.armed = True
            last = first + len(launches) - 1
            logger.info("node %d (%s): started ranks %d..%d", node_rank, spec.node_id, first, last)
            return self._relay()
        except ChannelError as exc:
            # The link failed (a send that could not leave, a closed link): no traceback.
            print(
                f"executor node: node rank {node_rank}: the link to the driver at "
                f"{link.address} failed: {exc}",
                file=sys.stderr,
            )
            return DRIVER_LOST_EXIT
        except KeyboardInterrupt:
            logger.info("node %d: interrupted; stopping its workers", node_rank)
            info = {"reason": "its agent was interrupted", "started": self._group is not None}
            with contextlib.suppress(ChannelError):
                self._send(Op.frame(Op.FAILED, info))
            return 130
        finally:
            if self._group is not None:
                self._group.stop(0.0)
            for cleanup in reversed(self._cleanups):
                with contextlib.suppress(Exception):
                    cleanup()

    def _free_port(self) -> int:
        """A port kept free on this machine's address, where node 0 hosts the torch
        rendezvous if the driver runs no ranks (0: none could be had)."""
        try:
            return reserve_port(self._join["address"] or "0.0.0.0")
        except OSError:
            return 0

    def _receive_spec(self) -> NodeSpec | int:
        """The answer to the join: this node's spec, or the exit status (said why on stderr)
        if the driver refused the agent, gave up before it started, or did not answer."""
        link, timeout = self._link, self._join_timeout
        try:
            message = link.recv(timeout)
        except ChannelTimeoutError:
            print(
                f"executor node: the driver at {link.address} took this agent's connection but "
                f"did not answer its join within --join-timeout={timeout:g} s. A "
                "starting driver sends the agents their work once every node has joined: start "
                "the other nodes' agents, or give a longer --join-timeout. A driver that failed "
                "or is shutting down no longer answers: start this agent again for the next "
                "executor.",
                file=sys.stderr,
            )
            return DRIVER_LOST_EXIT
        op = bytes(message.parts[0]) if message.parts else b""
        if op == Op.REFUSED:
            info = Op.read(message.parts)
            remedy = _REMEDIES.get(str(info.get("refusal", "")), "")
            awaited = info.get("awaited")
            if remedy == _REMEDIES[Refusal.TAKEN] and isinstance(awaited, list) and awaited:
                remedy = (
                    "each node rank takes one agent: stop this one, or start it with a node "
                    f"rank still awaited (--node-rank {', '.join(map(str, awaited))})"
                )
            print(
                f"executor node: the driver at {link.address} refused node rank "
                f"{self._node_rank}: {info.get('reason', 'no reason given')}"
                + (f"; {remedy}" if remedy else ""),
                file=sys.stderr,
            )
            return REFUSED_EXIT
        if op == Op.KILL:
            if Op.read(message.parts).get("rejoin") is True:
                return _REJOIN
            print(
                f"executor node: the driver at {link.address} gave up before this node started "
                "(its start failed: see its error); start this agent again for the next executor",
                file=sys.stderr,
            )
            return REFUSED_EXIT
        if op != Op.SPEC or len(message.parts) != 2:
            raise ExecutorError(f"the driver sent {op!r} instead of this node's spec")
        # The link has authenticated the driver: only a holder of the secret sent this.
        spec = pickle.loads(message.parts[1])
        if not isinstance(spec, NodeSpec):
            raise ExecutorError(f"the driver sent a {type(spec).__name__} as this node's spec")
        return spec

    def _on_death(self, index: int, exitcode: int) -> None:
        """Monitor thread: hand the death to the relay thread, which owns the link."""
        self._deaths.append((index, exitcode))
        self._death_bell.ring()

    def _relay(self) -> int:
        interval = self._timeout / 4
        bells = (self._channel.reply_bell, self._death_bell)
        fds = [bell.fd for bell in bells]
        looked = time.monotonic()
        while True:
            now = time.monotonic()
            if now - looked > 2 * interval:
                # This process was not scheduled (or was busy) for a while: what the driver
                # sent meanwhile is read below, so its silence only counts from here.
                self._last_seen = max(self._last_seen, now - interval)
            wait = max(0.0, min(interval, self._last_sent + interval - now))
            frames_waiting, woken = self._link.wait(wait, fds)
            looked = time.monotonic()
            for bell in bells:
                if bell.fd in woken:
                    bell.clear()
            self._forward_replies()
            # A worker died: the driver decides (KILL to stop, or to rejoin for a recovery);
            # meanwhile this node keeps its link and heartbeats.
            self._report_deaths()
            if frames_waiting:
                status = self._receive()
                if status is not None:
                    return status
            now = time.monotonic()
            if now >= self._last_sent + interval:
                self._send([Op.PING])
            # Both ends wait out silence longer until every rank is ready (machines are busy
            # starting workers); the driver says when.
            limit = self._timeout if self._all_ready else max(self._timeout, Hub.STARTUP_SILENCE_S)
            if now - self._last_seen > limit:
                logger.error(
                    "node %d: the driver sent nothing for %.1f s; stopping this node's workers",
                    self._node_rank,
                    now - self._last_seen,
                )
                return DRIVER_LOST_EXIT

    def _drain(self) -> int | None:
        """Read everything the driver sent: calls and replacements are queued for the ring;
        an exit status if the driver stopped this node."""
        group = self._group
        assert group is not None  # the driver's orders follow the spec
        while (message := self._link.recv_now()) is not None:
            self._last_seen = time.monotonic()
            chunks = message.chunks
            op = b"".join(chunks[0]) if chunks else b""
            if op == Op.CALL and len(chunks) >= 2:
                # As it arrived (in parts, a large one in chunks): the ring takes the pieces
                # back to back, unjoined.
                self._pending.append(tuple(piece for part in chunks[1:] for piece in part))
                continue
            parts = message.parts
            if op == Op.READY:
                self._all_ready = True
                group.start_spares()
            elif op == Op.PROBE:
                # Asked only once a call waited the hang bound (replies are stalled anyway).
                info = Op.read(parts)
                timeout = min(float(info["timeout_s"]), _MAX_PROBE_S)
                silent = group.probe(self._indices(info), timeout)
                answer = {
                    "token": info["token"],
                    "silent": sorted(self._first_rank + index for index in silent),
                }
                if info.get("port"):  # a new rendezvous on this machine (a replacement)
                    answer["port"] = self._free_port()
                self._send(Op.frame(Op.PROBED, answer))
            elif op == Op.END:  # declared hung: their deaths are reported as the driver's doing
                self._ended.update(ended := self._indices(Op.read(parts)))
                group.kill(ended)
            elif op == Op.REPLACE and len(parts) == 3:
                # In order with the calls: the calls before it are for the dead processes.
                self._pending.append(Op.read(parts) | {"launches": bytes(parts[2])})
            elif op == Op.KILL:
                if Op.read(parts).get("rejoin") is True:
                    return _REJOIN
                logger.info("node %d: the driver stopped this node", self._node_rank)
                return 1 if self._lost_worker else 0
        return None

    def _indices(self, info: dict[str, Any]) -> list[int]:
        """The indices of this node's workers among ``info["ranks"]``."""
        first = self._first_rank
        held = range(first, first + len(self._channel.replies))
        return [rank - first for rank in info["ranks"] if rank in held]

    def _receive(self) -> int | None:
        """Handle what the driver sent, writing its calls into the ring in order; an exit
        status once this node is done."""
        status = self._drain()
        if status is not None:
            return status
        while self._pending:
            frame = self._pending.popleft()
            if isinstance(frame, dict):
                self._replace(frame)
                continue
            self._skip_dead()
            nbytes = sum(piece.nbytes for piece in frame)
            try:
                self._channel.write_call(frame, nbytes, None, self._while_writing)
            except _Killed as killed:
                return int(killed.args[0])
            if nbytes and frame[0][0] == Kind.STOP:
                return self._stop()
        return None

    def _replace(self, order: dict[str, Any]) -> None:
        """The driver's rank replacement (``WorkerGroup.replace``); a rank that could not be
        replaced is reported dead (the driver then restarts every rank)."""
        assert self._group is not None
        # The link has authenticated the driver: only a holder of the secret sent this.
        launches = pickle.loads(order["launches"])
        wanted = {self._first_rank + index for index in self._indices(order)}
        mine = [launch for launch in launches if launch.rank in wanted]
        self._ended.update(launch.rank - self._first_rank for launch in mine)
        failed = self._group.replace(mine, self._first_rank)
        # The old processes' deaths seen by now, as ended (an END may come after the REPLACE).
        self._report_deaths()
        self._ended.difference_update(launch.rank - self._first_rank for launch in mine)
        for rank, exc in failed:
            logger.error("rank %d could not be replaced: %s", rank, exc)
            self._deaths.append((rank - self._first_rank, -1))
        self._dead.difference_update(launch.rank - self._first_rank for launch in mine)
        # Replaced: this node's workers are whole again (its exit status says so).
        self._lost_worker = bool(failed or self._dead)
        self._report_deaths()

    def _skip_dead(self) -> None:
        """A dead worker reads nothing: count it as having read every call written, so that
        the ring never waits for it (the calls it misses were for it alone to fail)."""
        for index in self._dead:
            self._channel.calls.resume_reader(index)

    def _while_writing(self) -> None:
        """The call ring is full: replies, heartbeats and the driver's messages go on."""
        self._skip_dead()
        self._forward_replies()
        status = self._drain()
        if status is not None:
            raise _Killed(status)
        if time.monotonic() >= self._last_sent + self._timeout / 4:
            self._send([Op.PING])

    def _stop(self) -> int:
        """The stop frame is in the ring: wait for the workers to finish, then say BYE."""
        assert self._group is not None
        self._group.closing = True
        self._forward_replies()
        self._group.stop(self._grace)
        self._forward_replies()
        self._send([Op.BYE])
        logger.info("node %d: its workers stopped", self._node_rank)
        return 0

    def _forward_replies(self) -> None:
        for ring in self._channel.replies:
            while ring.poll():
                frame = ring.read(_owned)
                if frame is not None:
                    self._send([Op.FRAME, frame])

    def _report_deaths(self) -> None:
        while self._deaths:
            self._lost_worker = True
            index, exitcode = self._deaths.popleft()
            self._dead.add(index)
            self._forward_replies()  # what it answered before it died comes first
            info = {"rank": self._first_rank + index, "exitcode": exitcode}
            info |= {"parent_died": exitcode == PARENT_DIED_EXIT, "ended": index in self._ended}
            self._ended.discard(index)
            self._send(Op.frame(Op.DIED, info))

    def _send(self, parts: Sequence[Any]) -> None:
        self._link.send(parts, timeout=self._timeout)
        self._last_sent = time.monotonic()


def _owned(view: Received) -> Any:
    """A reply frame to forward: the ring's slot memory is reused, so keep a copy (a
    message gathered from several slots is already a copy of its own)."""
    return bytes(view) if isinstance(view, memoryview) else view
