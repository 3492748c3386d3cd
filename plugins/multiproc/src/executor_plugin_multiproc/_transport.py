"""MultiprocTransport: the ``mp`` backend's side of the core's Transport contract.

It starts one worker process per rank, writes each call once into the broadcast ring and
reads the replies from the reply rings in :meth:`MultiprocTransport.poll`, which the core
calls from the thread that waits (``polls = True``: no thread hop per call). Everything else
about a call (ordering, reply gathering, timeouts, failure) is the core's.
"""

from __future__ import annotations

import contextlib
import pickle
import socket
import sys
import time
from typing import ClassVar

from executor_channel.codec import KIND_READY, KIND_STOP, encode, encode_call
from executor_channel.shm import Doorbell, NodeRings, Reply, RingAbortedError, decode_reply
from executor_core import ConfigError, ExecutorError, ExecutorFailedError, WorkerDiedError
from executor_core.backend import Call, RemoteFailure, Transport, TransportHost

from ._group import WorkerGroup
from ._local import WorkerLaunch, start_workers
from ._node_protocol import NodeSpec
from ._options import MultiprocOptions
from ._process import PARENT_DIED_EXIT

# Not typing.TYPE_CHECKING's import cost; type checkers treat any constant of this name as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from executor_channel.hub import Hub  # zmq: imported by multi-node executors only

__all__ = ["MultiprocTransport"]

_BROKEN = (
    "a call was interrupted half-way through a transfer that spans several ring slots, so "
    "the rings are out of step; shut this executor down and create a new one"
)


class MultiprocTransport(Transport):
    """One worker process per rank on this machine, fed through shared-memory rings.

    A call is written once into a broadcast ring that every worker reads; each worker answers
    through its own reply ring. Waits spin briefly (``spin_s``), then sleep on an eventfd, so
    idle processes use no CPU. A monitor thread (:class:`WorkerGroup`) reports a worker's
    death to the core, which fails every call in flight and every later one.
    """

    polls: ClassVar[bool] = True

    def __init__(self, host: TransportHost) -> None:
        super().__init__(host)
        self._options: MultiprocOptions | None = None
        self._channel: NodeRings | None = None
        self._group: WorkerGroup | None = None
        #: The other nodes' agents (``num_nodes > 1``).
        self._nodes: Hub | None = None
        #: A failure reported by another node before the executor was ready.
        self._start_error: ExecutorFailedError | None = None
        self._armed = False
        #: Set by :meth:`interrupt`: blocked sends and polls return.
        self._aborted = False

    # --- start-up ----------------------------------------------------------------------

    def start(self) -> None:
        host = self.host
        config = host.config
        options = MultiprocOptions.from_backend_options(config.backend_options)
        self._options = options
        per_node = _ranks_per_node(config.world_size, config.num_nodes)
        check_devices(options, config.device, per_node, host.worker_env)
        channel = NodeRings(per_node, options.ring_sizes, host.add_cleanup)
        self._channel = channel
        self._calls_ring = channel.calls
        self._reply_rings = channel.replies
        self._reply_bell = channel.reply_bell
        self._spinner = channel.spinner
        nodes = None
        if config.num_nodes > 1:
            nodes = self._join_nodes(options, channel.reply_bell)
            node_ids = [socket.gethostname()] + [node.hostname for node in nodes.nodes]
            if len(set(node_ids)) < len(node_ids):  # several agents on one machine
                node_ids = [f"{name}#{i}" for i, name in enumerate(node_ids)]
            contexts = host.contexts(
                [node_ids[rank // per_node] for rank in range(config.world_size)]
            )
        else:
            contexts = host.contexts()
        launches = [WorkerLaunch.of(host.wrapper(context), config.env) for context in contexts]
        group = start_workers(
            channel, launches[:per_node], options, host.add_cleanup, self._on_worker_death
        )
        self._group = group
        if nodes is not None:
            for node in nodes.nodes:
                first = node.node_rank * per_node
                spec = NodeSpec(
                    node_rank=node.node_rank,
                    node_id=node_ids[node.node_rank],
                    launches=tuple(launches[first : first + per_node]),
                    options=options,
                    device=config.device,
                    worker_env=host.worker_env,
                )
                ranks = range(first, first + per_node)
                nodes.send_spec(node, spec.node_id, ranks, pickle.dumps(spec, protocol=5))
            nodes.start()
            self._nodes = nodes
        self._wait_until_ready(group, options.startup_timeout, config.world_size)
        group.armed = True
        self._armed = True
        if nodes is not None:
            nodes.ready = True
            nodes.wake()
        # A worker may have died between its handshake and arming the monitor.
        for rank in range(per_node):
            code = group.exit_code(rank)
            if code is not None:
                raise _died(rank, code, "right after start-up")
        if self._start_error is not None:
            raise self._start_error

    def _join_nodes(self, options: MultiprocOptions, reply_bell: Doorbell) -> Hub:
        """Listen for the agents of nodes 1.. and wait until each has joined."""
        # zmq: imported by multi-node executors only
        from executor_channel import ChannelError, Listener, SecretError, load_secret
        from executor_channel.hub import Hub

        from . import __version__

        config = self.host.config
        try:
            secret = load_secret()
        except SecretError as exc:
            raise ConfigError(
                "num_nodes",
                config.num_nodes,
                f"the node agents authenticate with a shared secret: {exc}",
            ) from None
        try:
            listener = Listener(secret, host=config.distributed_host, port=options.node_port)
        except ChannelError as exc:  # the port is taken
            raise ConfigError(
                "backend_options",
                {"node_port": options.node_port},
                f"{exc}; pick a free port with backend_options['node_port'] (and the agents' "
                "--master-port)",
            ) from None
        self.host.add_cleanup(listener.close)
        nodes = Hub(listener, options.node_timeout_s, reply_bell, self._on_node_failure)
        self.host.add_cleanup(lambda: nodes.stop(False, 0.0))
        hint = (
            "on each of those machines run 'executor node --node-rank N --master-addr HOST "
            f"--master-port {listener.port}', where HOST is this machine's distributed_host as "
            "seen from there, with the same EXECUTOR_CHANNEL_SECRET (or "
            "EXECUTOR_CHANNEL_SECRET_FILE) as here"
        )
        nodes.join(range(1, config.num_nodes), __version__, options.startup_timeout, hint)
        return nodes

    def _wait_until_ready(self, group: WorkerGroup, timeout: float, world_size: int) -> None:
        deadline = time.monotonic() + timeout
        pending = set(range(world_size))
        local = range(len(self._reply_rings))
        inbox = self._nodes.inbox if self._nodes is not None else None
        while True:
            for rank in sorted(pending.intersection(local)):
                ring = self._reply_rings[rank]
                while ring.poll():
                    reply = ring.read(decode_reply)
                    if reply is not None:
                        self._ready(reply, pending)
            while inbox:
                self._ready(inbox.popleft(), pending)
            if not pending:
                return
            if self._start_error is not None:
                raise self._start_error
            for rank in sorted(pending.intersection(local)):
                code = group.exit_code(rank)
                if code is not None and not self._reply_rings[rank].poll():
                    raise _died(rank, code, "during start-up; its stderr has the details")
            now = time.monotonic()
            if now >= deadline:
                raise ExecutorError(
                    f"worker rank(s) {sorted(pending)} did not finish init_device/load_model "
                    f"within startup_timeout={timeout:g} s (backend_options)"
                )
            # Short naps: a worker that dies before its handshake rings no doorbell.
            self._reply_bell.wait(min(deadline - now, 0.05))

    @staticmethod
    def _ready(reply: Reply, pending: set[int]) -> None:
        kind, _seq, rank, ok, value = reply
        if kind != KIND_READY:
            return
        if not ok:
            raise value.to_error() if isinstance(value, RemoteFailure) else value
        pending.discard(rank)

    # --- calls -------------------------------------------------------------------------

    def send(self, call: Call) -> bool:
        method = call.method
        reply_rank = call.reply_rank
        parts, nbytes = encode_call(
            -1 if reply_rank is None else reply_rank,
            call.seq,
            method if type(method) is str else call.wire_method,
            call.args,
            call.kwargs,
        )
        try:
            sent = self._calls_ring.write(parts, nbytes, call.deadline, self._while_sending)
            if sent and self._nodes is not None:  # only once every local rank has it
                self._nodes.broadcast(parts)
            return sent
        except RingAbortedError:
            raise self._closed_error() from None
        except BaseException:
            self._check_rings()
            raise

    def _while_sending(self) -> None:
        """The call ring is full: stop if interrupted, else let replies flow (a worker blocked
        on a full reply ring can then go on and free its call slot)."""
        self._check_abort()
        self.host.while_blocked()

    def poll(self, timeout: float | None) -> None:
        """Hand every reply ready on the rings to the core; if none was, wait for one (spin,
        then the reply doorbell) up to ``timeout``. Often the replies are already there: one
        look at each ring is the whole call."""
        deliver = self.host.deliver
        abort = self._check_abort
        got = False
        try:
            for ring in self._reply_rings:
                reply = ring.try_read(decode_reply, abort)
                if reply is not None:
                    deliver(reply[1], reply[2], reply[3], reply[4])
                    got = True
            if self._nodes is not None and self._deliver_remote():
                got = True
            if not got and (timeout is None or timeout > 0.0) and not self._aborted:
                self._wait_and_read(timeout)
        except RingAbortedError:
            return
        except BaseException:
            self._check_rings()
            raise

    def _wait_and_read(self, timeout: float | None) -> None:
        """Spin briefly, then sleep on the reply doorbell, until a reply is delivered, the
        timeout passes or :meth:`interrupt` is called."""
        rings = self._reply_rings
        deliver = self.host.deliver
        abort = self._check_abort
        spinner = self._spinner
        bell = self._reply_bell
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        spin_until = spinner.start()
        while True:
            if now < spin_until and spinner.pause():
                pass  # a reply is often only microseconds away
            else:
                spin_until = 0.0
                # Replies and interrupt() ring this doorbell; a stale ring costs one look.
                bell.wait(None if deadline is None else max(0.0, deadline - now))
            got = False
            for ring in rings:
                reply = ring.try_read(decode_reply, abort)
                if reply is not None:
                    deliver(reply[1], reply[2], reply[3], reply[4])
                    got = True
            if self._nodes is not None and self._deliver_remote():
                got = True
            if got or self._aborted:
                return
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return

    def _deliver_remote(self) -> bool:
        """Hand the replies that came from other nodes to the core; True if there were any."""
        assert self._nodes is not None
        inbox = self._nodes.inbox
        deliver = self.host.deliver
        got = False
        while inbox:
            _kind, seq, rank, ok, value = inbox.popleft()
            deliver(seq, rank, ok, value)
            got = True
        return got

    def _check_abort(self) -> None:
        if self._aborted:
            raise RingAbortedError("the executor failed or is closing")

    def _closed_error(self) -> ExecutorError:
        error = self.host.closed_error
        if error is not None:
            return error
        return ExecutorError("the executor failed or is closing")

    def _check_rings(self) -> None:
        """After an interrupted send or read: fail the executor if a ring is mid-message."""
        channel = self._channel
        if channel is not None and channel.broken:
            self.host.worker_died(ExecutorFailedError(_BROKEN))

    # --- failure and stop ------------------------------------------------------------------

    def _on_worker_death(self, rank: int, exitcode: int) -> None:
        """Monitor thread: a worker ended while the executor was running."""
        self.host.worker_died(_died(rank, exitcode, ""))
        group, options = self._group, self._options
        if group is not None and options is not None:
            group.terminate(options.shutdown_grace_s)

    def _on_node_failure(self, error: ExecutorFailedError) -> None:
        """Node pump thread: a node, its agent or one of its workers is gone."""
        if not self._armed:  # start() raises it
            if self._start_error is None:
                self._start_error = error
            return
        self.host.worker_died(error)

    def interrupt(self) -> None:
        self._aborted = True
        channel = self._channel
        if channel is not None:
            channel.wake()

    def close(self, graceful: bool) -> None:
        group, options = self._group, self._options
        if group is None or options is None:
            return  # start-up failed before any process was made
        group.closing = True
        nodes = self._nodes
        if graceful and group.armed and not self._aborted:
            parts, nbytes = encode(KIND_STOP, True, -1, 0, None)
            deadline = time.monotonic() + options.shutdown_grace_s
            sent = False
            with contextlib.suppress(RingAbortedError):
                sent = self._calls_ring.write(parts, nbytes, deadline, self._while_sending)
            if sent and nodes is not None:
                nodes.broadcast(parts)
            group.stop(options.shutdown_grace_s, options.shutdown_grace_s)
            if nodes is not None:
                nodes.stop(True, options.shutdown_grace_s)
        else:
            if nodes is not None:
                nodes.stop(False, 0.0)
            group.kill_now()


def check_devices(
    options: MultiprocOptions, device: str, workers: int, env: dict[str, str]
) -> None:
    """Refuse, before any worker starts, what would fail in the workers: fork once CUDA is
    initialised here (a forked child cannot use CUDA), or fewer GPUs than workers."""
    torch = sys.modules.get("torch")
    if options.start_method == "fork" and torch is not None and torch.cuda.is_initialized():
        raise ConfigError(
            "backend_options",
            {"start_method": "fork"},
            "CUDA is already initialised in this process, and a forked worker cannot use it "
            "('Cannot re-initialize CUDA in forked subprocess'); use start_method='spawn' "
            "(the default) or 'forkserver'",
        )
    if device == "cuda":
        from executor_core.torch import check_gpu_per_local_rank  # imports torch: cuda only

        check_gpu_per_local_rank(workers, env)


def _ranks_per_node(world_size: int, num_nodes: int) -> int:
    if world_size % num_nodes:
        raise ConfigError(
            "num_nodes",
            num_nodes,
            f"the mp backend puts the same number of ranks on every node, and world_size="
            f"{world_size} is not a multiple of num_nodes={num_nodes}",
        )
    return world_size // num_nodes


def _died(rank: int, exitcode: int, when: str) -> WorkerDiedError:
    detail = when
    if exitcode == PARENT_DIED_EXIT:
        detail = ", ".join(filter(None, [when, "it saw its driver die"]))
    if exitcode < 0:
        return WorkerDiedError(rank, signal=-exitcode, detail=detail)
    return WorkerDiedError(rank, exitcode=exitcode, detail=detail)
