"""One session of an ``executor node`` agent with its driver (:class:`NodeAgent`): join, receive
this node's spec, start its workers on a shared-memory channel of its own, then relay. Each
call frame from the driver is written once into the node's ring (every local worker reads
it), and each reply frame is sent back as it is, never unpickled here. One thread owns the
link; it sleeps in one poll on the link and the reply and death doorbells. It also answers
the driver's liveness probes of its workers (the hang bound).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from executor_channel import (
    ChannelError,
    Connection,
    Doorbell,
    Hub,
    Kind,
    NodeRings,
    Op,
    Received,
)
from executor_core import ConfigError, ExecutorError
from executor_core.backend import reserve_port

from ._agent_status import DRIVER_LOST_EXIT, REJOIN, receive_spec
from ._group import WorkerGroup
from ._local import check_devices, start_workers
from ._node_protocol import NodeSpec
from ._node_workers import NodeWorkers, Replace
from ._process import PARENT_DIED_EXIT

__all__ = ["NodeAgent"]

logger = logging.getLogger("executor_plugin_multiproc.agent")


class NodeAgent:
    """One session with the driver: join, start this node's workers, relay (see the module)."""

    def __init__(
        self,
        link: Connection,
        node_rank: int,
        join_timeout: float,
        num_nodes: int | None,
        identity: dict[str, str],
    ) -> None:
        self._link = link
        self._identity = identity
        self._node_rank = node_rank
        self._join_timeout = join_timeout
        self._num_nodes = num_nodes
        self._cleanups: list[Callable[[], None]] = []
        self._deaths: collections.deque[tuple[int, int]] = collections.deque()
        self._death_bell = Doorbell()
        self._cleanups.append(self._death_bell.close)
        self._group: WorkerGroup | None = None
        self._spec: NodeSpec | None = None
        self._last_seen = time.monotonic()
        self._last_sent = 0.0
        self._all_ready = False
        #: A worker of this node died (the exit status is then 1).
        self._lost_worker = False
        #: Call frames received and not yet written into the ring (it was full), and the
        #: driver's rank replacements, in their order.
        self._pending: collections.deque[tuple[memoryview, ...] | Replace] = collections.deque()
        self._workers: NodeWorkers | None = None

    def run(self) -> int:
        from . import __version__

        link = self._link
        expects = {} if self._num_nodes is None else {"num_nodes": self._num_nodes}
        try:
            link.send(
                Op.frame(
                    Op.JOIN,
                    {
                        "node_rank": self._node_rank,
                        "hostname": socket.gethostname(),
                        "pid": os.getpid(),
                        "version": __version__,
                        "expects": expects,
                        **self._identity,
                        # Where node 0 hosts the torch rendezvous if the driver runs no ranks.
                        "port": _free_port(self._identity["address"] or "0.0.0.0"),
                    },
                ),
                timeout=self._join_timeout,
            )
            spec = receive_spec(link, self._node_rank, self._join_timeout)
            if isinstance(spec, int):
                return spec
            self._spec = spec
            try:
                self._start(spec)
            except (ConfigError, ExecutorError, OSError) as exc:
                self._send(
                    Op.frame(
                        Op.FAILED, {"reason": f"starting its workers: {exc}", "started": False}
                    )
                )
                return 1
            return self._relay(spec)
        except ChannelError as exc:
            # The link failed (a send that could not leave, a closed link): no traceback.
            print(
                f"executor node: node rank {self._node_rank}: the link to the driver at "
                f"{link.address} failed: {exc}",
                file=sys.stderr,
            )
            return DRIVER_LOST_EXIT
        except KeyboardInterrupt:
            logger.info("node %d: interrupted; stopping its workers", self._node_rank)
            with contextlib.suppress(ChannelError):
                self._send(
                    Op.frame(
                        Op.FAILED,
                        {"reason": "its agent was interrupted", "started": self._group is not None},
                    )
                )
            return 130
        finally:
            group = self._group
            if group is not None:
                group.closing = True
                group.kill_now()
            for cleanup in reversed(self._cleanups):
                with contextlib.suppress(Exception):
                    cleanup()

    def _start(self, spec: NodeSpec) -> None:
        check_devices(spec.options, spec.device, len(spec.launches), spec.worker_env)
        channel = NodeRings(len(spec.launches), spec.options.ring_sizes, self._cleanups.append)
        self._channel = channel
        first = spec.launches[0].rank
        self._first_rank = first
        self._group = start_workers(
            channel,
            spec.launches,
            spec.options,
            self._cleanups.append,
            self._on_death,
            spares=spec.spares,
            preload=spec.preload,
        )
        self._group.armed = True
        self._workers = NodeWorkers(channel, self._group, first)
        last = first + len(spec.launches) - 1
        logger.info("node %d (%s): started ranks %d..%d", spec.node_rank, spec.node_id, first, last)

    def _on_death(self, index: int, exitcode: int) -> None:
        """Monitor thread: hand the death to the relay thread, which owns the link."""
        self._deaths.append((index, exitcode))
        self._death_bell.ring()

    # --- the relay ------------------------------------------------------------------------

    def _relay(self, spec: NodeSpec) -> int:
        link = self._link
        channel = self._channel
        timeout = spec.options.node_timeout_s
        interval = timeout / 4
        bells = (channel.reply_bell, self._death_bell)
        fds = [bell.fd for bell in bells]
        looked = time.monotonic()
        while True:
            now = time.monotonic()
            if now - looked > 2 * interval:
                # This process was not scheduled (or was busy) for a while: what the driver
                # sent meanwhile is read below, so its silence only counts from here.
                self._last_seen = max(self._last_seen, now - interval)
            frames_waiting, woken = link.wait(max(0.0, min(interval, self._next_ping() - now)), fds)
            looked = time.monotonic()
            for bell in bells:
                if bell.fd in woken:
                    bell.clear()
            self._forward_replies()
            # A worker died: the driver decides (KILL to stop, or to rejoin for a recovery);
            # meanwhile this node keeps its link and heartbeats.
            self._report_deaths()
            if frames_waiting:
                status = self._receive(channel)
                if status is not None:
                    return status
            now = time.monotonic()
            if now >= self._next_ping():
                self._send([Op.PING])
            # Both ends wait out silence longer until every rank is ready (machines are busy
            # starting workers); the driver says when.
            limit = timeout if self._all_ready else max(timeout, Hub.STARTUP_SILENCE_S)
            if now - self._last_seen > limit:
                logger.error(
                    "node %d: the driver sent nothing for %.1f s; stopping this node's workers",
                    self._node_rank,
                    now - self._last_seen,
                )
                return DRIVER_LOST_EXIT

    def _next_ping(self) -> float:
        assert self._spec is not None
        return self._last_sent + self._spec.options.node_timeout_s / 4

    def _drain(self) -> int | None:
        """Read everything the driver sent: calls are queued for the ring; an exit status if
        the driver stopped this node."""
        recv_now = self._link.recv_now
        while (message := recv_now()) is not None:
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
                if self._group is not None:
                    self._group.start_spares()
            elif op == Op.PROBE:
                info = Op.read(parts)
                silent = self._nodes_workers().probe(info)
                self._send(Op.frame(Op.PROBED, {"token": info.get("token"), "silent": silent}))
            elif op == Op.END:
                self._nodes_workers().end(Op.read(parts))
            elif op == Op.REPLACE and len(parts) == 3:
                # In order with the calls: the calls before it are for the dead processes.
                self._pending.append(Replace(Op.read(parts), bytes(parts[2])))
            elif op == Op.KILL:
                if Op.read(parts).get("rejoin") is True:
                    return REJOIN
                logger.info("node %d: the driver stopped this node", self._node_rank)
                return 1 if self._lost_worker else 0
        return None

    def _receive(self, rings: NodeRings) -> int | None:
        """Handle what the driver sent, writing its calls into the ring in order; an exit
        status once this node is done."""
        status = self._drain()
        if status is not None:
            return status
        pending = self._pending
        while pending:
            frame = pending.popleft()
            if isinstance(frame, Replace):
                failed = self._nodes_workers().replace(frame)
                for index in failed:
                    self._deaths.append((index, -1))
                # Replaced: this node's workers are whole again (its exit status says so).
                self._lost_worker = bool(failed or self._nodes_workers().dead)
                self._report_deaths()
                continue
            self._nodes_workers().skip_dead()
            nbytes = sum(piece.nbytes for piece in frame)
            try:
                rings.write_call(frame, nbytes, None, self._while_writing)
            except _Killed as killed:
                return killed.status
            if nbytes and frame[0][0] == Kind.STOP:
                return self._stop()
        return None

    def _nodes_workers(self) -> NodeWorkers:
        assert self._workers is not None  # the driver's orders follow the spec
        return self._workers

    def _while_writing(self) -> None:
        """The node's call ring is full (its workers are busy): keep replies, heartbeats and
        the driver's messages flowing meanwhile, so that a long call is no silence."""
        self._nodes_workers().skip_dead()
        self._forward_replies()
        status = self._drain()
        if status is not None:
            raise _Killed(status)
        if time.monotonic() >= self._next_ping():
            self._send([Op.PING])

    def _stop(self) -> int:
        """The stop frame is in the ring: wait for the workers to finish, then say BYE."""
        assert self._group is not None
        assert self._spec is not None
        grace = self._spec.options.shutdown_grace_s
        self._group.closing = True
        self._forward_replies()
        self._group.stop(grace, grace)
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

    def _report_deaths(self) -> bool:
        if not self._deaths:
            return False
        self._lost_worker = True
        while self._deaths:
            index, exitcode = self._deaths.popleft()
            self._nodes_workers().dead.add(index)
            rank = self._first_rank + index
            self._forward_replies()  # what it answered before it died comes first
            self._send(
                Op.frame(
                    Op.DIED,
                    {
                        "rank": rank,
                        "exitcode": exitcode,
                        "parent_died": exitcode == PARENT_DIED_EXIT,
                    },
                )
            )
        return True

    def _send(self, parts: Sequence[Any]) -> None:
        assert self._spec is not None or parts[0] != Op.PING
        timeout = self._spec.options.node_timeout_s if self._spec else self._join_timeout
        self._link.send(parts, timeout=timeout)
        self._last_sent = time.monotonic()


class _Killed(Exception):
    """The driver said KILL while a call was being written into the full ring."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        #: What :meth:`NodeAgent.run` returns: 0, or :data:`REJOIN`.
        self.status = status


def _owned(view: Received) -> Any:
    """A reply frame to forward: the ring's slot memory is reused, so keep a copy (a
    message gathered from several slots is already a copy of its own)."""
    if isinstance(view, memoryview):
        return bytes(view)
    return view  # a PickleBuffer (read without ``assemble``, so never an Assembled)


def _free_port(address: str) -> int:
    """A TCP port kept free on ``address`` for the torch rendezvous (``reserve_port``), or 0
    if it cannot be bound here."""
    try:
        return reserve_port(address)
    except OSError:
        return 0
