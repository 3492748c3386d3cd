"""MultiprocExecutor, its options and its transport: one worker process per rank, on this
machine and on the other nodes' agents (``executor node``), which a
:class:`~.launcher.Placement` starts and the channel's hub joins. Calls and replies travel the
channel (:class:`~executor_channel.ChannelTransport`); every rule of a call is the
core's."""

from __future__ import annotations

import functools
import logging
import pickle
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import attrs

from executor_channel import ChannelOptions, ChannelTransport, Doorbell, NodeRings
from executor_core import (
    ConfigError,
    Executor,
    ExecutorError,
    ExecutorFailedError,
    NodeLostError,
    WorkerContext,
    WorkerDiedError,
)
from executor_core.backend import Transport, TransportHost, tcp_init_method
from executor_core.options import integer, number, one_of, option

from ._workers import NodeSpec, WorkerGroup, WorkerLaunch, check_devices, worker_died_error
from .launcher import AgentLaunch, ManualPlacement, Placement, agent_argv

TYPE_CHECKING = False
if TYPE_CHECKING:
    from executor_channel import Hub  # zmq: imported by multi-node executors only

__all__ = ["MultiprocExecutor", "MultiprocOptions", "MultiprocTransport"]

#: Under these names a group restart hands the next incarnation its placement, and the nodes
#: whose agents were lost (``{node_rank: (node_id, ranks)}``).
_KEPT, _LOST = "placement", "lost_nodes"

logger = logging.getLogger("executor_plugin_multiproc")


@attrs.frozen(kw_only=True)
class MultiprocOptions(ChannelOptions):
    """Knobs of the mp backend, read from ``ExecutorConfig.backend_options``: the channel's
    (:class:`~executor_channel.ChannelOptions`: ring sizes, spinning, heartbeats)
    and its own. ``MultiprocExecutor.options_cls``: the core refuses any other key."""

    #: How worker processes are started: "spawn" (default), "forkserver", or "fork" (only
    #: safe if the driver has no threads holding locks and no CUDA context yet).
    start_method: str = option("spawn", one_of("spawn", "forkserver", "fork"))
    #: Seconds to wait for every worker to report ready (``init_device`` + ``load_model``).
    startup_timeout: float = option(600.0, number(above=0.0))
    #: Seconds workers get to exit after the stop message before SIGTERM, and again before
    #: SIGKILL.
    shutdown_grace_s: float = option(5.0, number(at_least=0.0))
    #: With a recovery policy (``ExecutorConfig.recovery``): idle worker processes each node
    #: keeps started, the worker class's module imported, for a rank replacement to take
    #: over instead of starting a process. 0: none. Ignored with "fork".
    spare_workers: int = option(1, integer(at_least=0, at_most=64))
    #: With ``num_nodes > 1``: the TCP port on which the driver waits for the node agents
    #: (``executor node --master-port``), on ``ExecutorConfig.distributed_host``.
    node_port: int = option(29550, integer(at_least=1, at_most=65535))


class MultiprocTransport(ChannelTransport):
    """The ``mp`` backend's side of the core's Transport contract (see the module)."""

    def __init__(
        self,
        host: TransportHost,
        placement_cls: type[Placement] = ManualPlacement,
        options_cls: type[MultiprocOptions] = MultiprocOptions,
    ) -> None:
        super().__init__(host)
        self._placement_cls = placement_cls
        self._options = options_cls.from_backend_options(host.config.backend_options)
        self._group: WorkerGroup | None = None
        #: Ranks on this node (0 .. _local - 1); 0 where the driver runs no ranks.
        self._local = 0
        #: Every rank's context, as its worker last started or rejoined.
        self._contexts: list[WorkerContext] = []
        #: Ranks killed as hung (:meth:`kill`): their death is not news to the core.
        self._killed: set[int] = set()
        self._placement: Placement | None = None
        #: Each placed node's agent launch, by node rank (started again if it is lost).
        self._launches: dict[int, AgentLaunch] = {}
        #: What every node's spec holds besides its ranks' launches.
        self._common: tuple[MultiprocOptions, str, dict[str, str], int, str] | None = None

    # --- start-up ----------------------------------------------------------------------

    def start(self) -> None:
        host = self.host
        config = host.config
        options = self._options
        if config.world_size % config.num_nodes:
            raise ConfigError(
                "num_nodes",
                config.num_nodes,
                f"the mp backend puts the same number of ranks on every node, and world_size="
                f"{config.world_size} is not a multiple of num_nodes={config.num_nodes}",
            )
        per_node = config.world_size // config.num_nodes
        placement = None
        if config.num_nodes > 1:
            # The one the previous incarnation kept, or a new one; kept for the next
            # incarnation while the executor restarts, closed otherwise.
            placement = host.take(_KEPT) or self._placement_cls(config, options)
            host.keep(_KEPT, placement, placement.close)
        local = self._local = per_node if placement is None or placement.driver_runs_ranks else 0
        channel = None
        if local:
            check_devices(options, config.device, per_node, host.worker_env)
            channel = NodeRings(per_node, options.ring_sizes, host.add_cleanup)
            self.attach_channel(channel)
        else:  # every rank on placed nodes: the hub's doorbell wakes the driver
            bell = Doorbell()
            host.add_cleanup(bell.close)
            self.attach_channel(None, reply_bell=bell)
        hub = None
        if placement is None:
            contexts = host.contexts()
        else:
            hub = self._join_nodes(placement, options)
            node_ids = [placement.node_id()] * bool(local) + [node.node_id for node in hub.nodes]
            if len(set(node_ids)) < len(node_ids):  # several agents on one machine
                node_ids = [f"{name}#{i}" for i, name in enumerate(node_ids)]
            for node, node_id in zip(hub.nodes, node_ids[bool(local) :], strict=True):
                node.node_id = node_id
            init_method = None
            if not local:  # node 0's agent hosts the rendezvous, where it said it is
                first = hub.nodes[0]
                if not first.address or not first.port:
                    raise ExecutorError(
                        f"node {first.describe()} gave no address and free port for the torch "
                        "rendezvous: start its agent with --address ADDRESS"
                    )
                init_method = tcp_init_method(first.address, first.port)
            contexts = host.contexts(
                [node_ids[rank // per_node] for rank in range(config.world_size)],
                init_method,
                {node.node_id: node.address for node in hub.nodes},
            )
        self._contexts = list(contexts)
        launches = [WorkerLaunch.of(host.wrapper(context), config.env) for context in contexts]
        spares = options.spare_workers if config.recovery is not None else 0
        worker_cls = config.worker_cls  # its "module:Class", for the spares to import
        if not isinstance(worker_cls, str):
            worker_cls = f"{worker_cls.__module__}:{worker_cls.__qualname__}"
        if channel is not None:
            self._group = WorkerGroup(
                channel,
                launches[:per_node],
                options,
                host.add_cleanup,
                self._on_worker_death,
                spares,
                worker_cls,
            )
        if hub is not None:
            self._common = (options, config.device, host.worker_env, spares, worker_cls)
            for node in hub.nodes:
                self._send_spec(hub, node, node.node_id, dict(enumerate(launches)))
            hub.start()
            self.hub = hub
        self.wait_until_ready(range(config.world_size), options.startup_timeout, self._check_start)
        group = self._group
        if group is not None:
            group.armed = True
        self.ready()
        if group is not None:
            group.start_spares()
            # A worker may have died between its handshake and arming the monitor.
            for rank in range(local):
                code = group.exit_code(rank)
                if code is not None:
                    raise worker_died_error(rank, code, "right after start-up")
        if placement is not None:
            placement._report_lost = self._agent_lost
        self._placement = placement

    def _send_spec(
        self, hub: Hub, node: Any, node_id: str, launches: Mapping[int, WorkerLaunch]
    ) -> None:
        """Send ``node`` (a member of ``hub``) its spec: its ranks' ``launches``."""
        assert self._common is not None
        ranks = self._node_ranks(node.node_rank)
        spec = NodeSpec(node.node_rank, node_id, tuple(launches[r] for r in ranks), *self._common)
        hub.send_spec(node, node_id, ranks, pickle.dumps(spec, protocol=5))

    def _join_nodes(self, placement: Placement, options: MultiprocOptions) -> Hub:
        """Listen for the agents of the nodes without the driver's ranks, have the placement
        start them, and wait until each has joined."""
        from executor_channel import ChannelError, Hub, Listener  # zmq: multi-node only

        from . import __version__

        host, config = self.host, self.host.config
        secret, port = placement.secret(), placement.port()
        try:
            listener = Listener(secret, host=config.distributed_host, port=port)
        except ChannelError as exc:  # the port is taken
            raise ConfigError(
                "backend_options",
                {"node_port": port},
                f"{exc}; pick a free port with backend_options['node_port'] (and the agents' "
                "--master-port)",
            ) from None
        host.add_cleanup(listener.close)
        master = config.distributed_host
        if master in ("0.0.0.0", "::"):  # listening everywhere: agents dial this host's name
            master = socket.gethostname()
        timeout = options.startup_timeout
        launches = {
            node_rank: AgentLaunch(
                node_rank=node_rank,
                argv=agent_argv(node_rank, config.num_nodes, master, listener.port, timeout),
                env=secret.to_env(),
                secret=secret,
                address=listener.address,
            )
            for node_rank in range(int(bool(self._local)), config.num_nodes)
        }
        self._launches = launches
        hub = Hub(listener, options.node_timeout_s, self.reply_bell, self._remote_failure)
        # Cleanups run last in, first out: the hub tells the agents to stop, then the
        # placement reaps them.
        for launch in launches.values():
            placement.start(launch)
            host.add_cleanup(functools.partial(placement.stop, launch))
        host.add_cleanup(lambda: hub.stop(False, 0.0))

        def check(awaited: frozenset[int]) -> None:
            for node_rank in sorted(awaited):
                placement.check(launches[node_rank])

        lost: dict[int, tuple[str, tuple[int, ...]]] = host.take(_LOST) or {}
        try:
            hub.join(
                list(launches),
                __version__,
                timeout,
                placement.hint(tuple(launches.values())),
                terms={"num_nodes": config.num_nodes},  # an agent's --num-nodes, if it gave one
                check=check,
            )
        except ExecutorError as exc:
            gone = sorted(set(lost) & hub.awaited)
            if not gone:
                raise
            # One attempt, bounded by startup_timeout: another would wait as long for nothing.
            node_id, ranks = lost[gone[0]]
            raise NodeLostError(
                node_id,
                ranks,
                f"its agent was lost, and none joined again within startup_timeout="
                f"{timeout:g} s ({exc})",
                f"start an agent for node rank {gone[0]} there, then call recover() (or "
                "create a new executor)",
            ) from exc
        return hub

    def _check_start(self, pending: set[int]) -> None:
        """Between waits for the ready frames: a local worker that died ends the start."""
        for rank in sorted(rank for rank in pending if rank < self._local):
            code = self._group.exit_code(rank) if self._group is not None else None
            if code is not None and self.rings is not None and not self.rings.replies[rank].poll():
                raise worker_died_error(rank, code, "during start-up; its stderr has the details")

    # --- probes, hangs and rank replacement -------------------------------------------------

    def probe(self, ranks: Sequence[int], timeout: float) -> set[int]:
        # The remote ranks' agents are asked first, and answer while the local ranks are.
        local = [rank for rank in ranks if rank < self._local]
        remote = [rank for rank in ranks if rank >= self._local]
        wait_remote = self.hub.probe(remote, timeout) if self.hub is not None and remote else set
        silent = self._group.probe(local, timeout) if self._group is not None and local else set()
        return silent | wait_remote()

    def kill(self, ranks: Sequence[int]) -> None:
        self._killed.update(ranks)
        if self._group is not None:
            self._group.kill([rank for rank in ranks if rank < self._local])
        if self.hub is not None and (remote := [rank for rank in ranks if rank >= self._local]):
            self.hub.end(remote)

    def replace(
        self, ranks: Sequence[int], rejoin: Callable[[Sequence[WorkerContext]], None]
    ) -> None:
        group, options, hub, host = self._group, self._options, self.hub, self.host
        self.resume()
        remote = [rank for rank in ranks if rank >= self._local]
        # A lost node's ranks go to the agent that joins again in its place.
        rejoined = self._rejoined(remote) if hub is not None else {}
        moved = {rank: m for m in rejoined.values() for rank in self._node_ranks(m.node_rank)}
        if group is not None:  # a new rendezvous on this host, as at start
            init_method = host.rendezvous()
        else:  # on node 0's machine, as at start, at a port its agent found free now
            assert hub is not None
            first = rejoined.get(0) or next(n for n in hub.nodes if n.node_rank == 0)
            port = first.port if 0 in rejoined else hub.fresh_port(first, options.node_timeout_s)
            if not port:
                raise ExecutorError(f"node {first.describe()} named no free port for a rendezvous")
            init_method = tcp_init_method(first.address, port)
        contexts = [
            attrs.evolve(
                c,
                distributed_init_method=init_method,
                node_address=moved[c.rank].address if c.rank in moved else c.node_address,
            )
            for c in self._contexts
        ]
        launches = {
            rank: WorkerLaunch.of(host.wrapper(contexts[rank]), host.config.env) for rank in ranks
        }
        for member in rejoined.values():
            ours = [contexts[rank].node_id for rank in self._node_ranks(member.node_rank)]
            self._send_spec(hub, member, ours[0], launches)  # type: ignore[arg-type]
        remote = [rank for rank in remote if rank not in moved]
        if remote:
            # Their agents start them, in order with the calls (the stale ones before).
            assert hub is not None
            hub.replace(remote, pickle.dumps(tuple(launches[r] for r in remote), protocol=5))
        if group is not None:
            failed = group.replace([launches[rank] for rank in ranks if rank < self._local], 0)
            if failed:
                rank, exc = failed[0]
                raise ExecutorError(f"rank {rank} could not be started again: {exc}") from exc
        self._killed.difference_update(ranks)
        rejoin(contexts)
        self.wait_until_ready(ranks, options.startup_timeout, self._check_start)
        for member in rejoined.values():
            hub.announce(member)  # type: ignore[union-attr]  # members rejoined: a hub
        self._contexts = contexts

    def _node_ranks(self, node_rank: int) -> range:
        per_node = self.host.config.world_size // self.host.config.num_nodes
        return range(node_rank * per_node, (node_rank + 1) * per_node)

    def _rejoined(self, remote: Sequence[int]) -> dict[int, Any]:
        """For each lost node holding some of ``remote``: its agent started again by the
        placement, and the member that joined in its place (within ``startup_timeout``)."""
        hub, placement = self.hub, self._placement
        assert hub is not None
        timeout = self._options.startup_timeout
        members = {}
        for node in list(hub.nodes):
            if not node.lost or not set(node.ranks) & set(remote):
                continue
            if not set(node.ranks) <= set(remote):
                raise ExecutorError(f"node {node.describe()} is lost, and not all its ranks died")
            check: Callable[[], None] = lambda: None  # noqa: E731
            launch = self._launches.get(node.node_rank)
            if placement is not None and launch is not None:
                placement.stop(launch)
                placement.start(launch)
                check = functools.partial(placement.check, launch)
            logger.info("node rank %d: awaiting an agent in the lost one's place", node.node_rank)
            member = hub.rejoined(node.node_rank, timeout, check)
            if member is None:
                raise NodeLostError(
                    node.node_id,
                    node.ranks,
                    f"its agent was lost, and a new one did not join within startup_timeout="
                    f"{timeout:g} s",
                    f"start an agent for node rank {node.node_rank} there, then call recover() "
                    "(or create a new executor)",
                )
            members[node.node_rank] = member
        return members

    # --- failure and stop ------------------------------------------------------------------

    def _agent_lost(self, node_rank: int, detail: str) -> None:
        """``Placement.agent_lost``: the scheduler ended that node's agent."""
        hub = self.hub
        for node in hub.nodes if hub is not None else []:
            if node.node_rank == node_rank:
                hub.lose(node, detail)  # type: ignore[union-attr]  # not None here

    def _remote_failure(self, error: ExecutorFailedError) -> None:
        """The hub's pump: a remote worker or node is gone (a rank killed as hung is not
        news: the core failed its calls already). A lost node's error waits for what its
        placement says of it (:meth:`~.launcher.Placement.explain`), on a thread."""
        ranks = getattr(error, "ranks", None)
        if isinstance(error, WorkerDiedError) and ranks and set(ranks) <= self._killed:
            return
        lost = [n for n in self.hub.nodes if n.lost and n.ranks == ranks] if self.hub else []
        placement = self._placement
        if not lost or placement is None or type(placement).explain is Placement.explain:
            self.report_failure(error)
            return
        node_rank, seen = lost[0].node_rank, error

        def explained() -> None:
            try:
                why = placement.explain(node_rank)
            except Exception as exc:  # noqa: BLE001 - the death is reported all the same
                why = f"(the placement could not say why: {exc})"
            told = seen
            if why and why not in str(seen) and isinstance(seen, WorkerDiedError):
                detail = f"{seen.detail}; {why}" if seen.detail else why
                told = WorkerDiedError(seen.rank, detail=detail, ranks=seen.ranks, node=seen.node)
            self.report_failure(told)

        threading.Thread(target=explained, name="executor-explain", daemon=True).start()

    def _on_worker_death(self, rank: int, exitcode: int) -> None:
        """Monitor thread: a worker ended while the executor was running."""
        if rank in self._killed:  # declared hung: the core failed its calls already
            return
        self.host.worker_died(worker_died_error(rank, exitcode, ""))
        if self._group is not None and self.host.config.recovery is None:
            # Fail-stop: the survivors go now (with a policy they may rejoin, or the group
            # restart stops them).
            self._group.terminate(self._options.shutdown_grace_s)

    def close(self, graceful: bool) -> None:
        group, options, host = self._group, self._options, self.host
        if not self.attached:
            return  # start-up failed before any process was made
        if self._placement is not None:
            self._placement._report_lost = None
        if group is not None:
            group.closing = True
        if graceful and self.is_ready and not self.aborted:
            self.send_stop(options.shutdown_grace_s)
            if group is not None:
                group.stop(options.shutdown_grace_s)
            self.stop_hub(True, options.shutdown_grace_s)
            return
        # A recovery: agents someone else started join the next incarnation (placed ones
        # are started anew by their placement); the next start names the nodes lost.
        if host.restarting and self.hub is not None:
            lost = {n.node_rank: (n.node_id, n.ranks) for n in self.hub.nodes if n.lost}
            if lost:
                host.keep(_LOST, lost, lambda: None)
        self.stop_hub(False, 0.0, host.restarting and self._placement_cls.agents_rejoin)
        if group is not None:
            group.stop(0.0)


class MultiprocExecutor(Executor):
    """Runs one worker process per rank (backend ``"mp"``): on this machine, and with
    ``num_nodes > 1`` on the other nodes' agents (``executor node``).

    Each call is written once into a shared-memory ring that every worker of a node reads;
    each worker answers through its own shared-memory reply ring. Every rule of a call
    (ordering, timeouts, reply gathering, failure, shutdown) is the core's. See the
    distribution's README for the ``backend_options`` keys.

    A backend that starts the agents through its own scheduler subclasses this class and
    sets :attr:`placement_cls` (see :mod:`executor_plugin_multiproc.launcher`).
    """

    transport_cls: ClassVar[type[Transport]] = MultiprocTransport
    #: The backend_options it takes (the core refuses any other key).
    options_cls = MultiprocOptions
    #: Where the agents of a multi-node executor run and who starts them: by default
    #: someone else (:class:`~executor_plugin_multiproc.launcher.ManualPlacement`).
    placement_cls: ClassVar[type[Placement]] = ManualPlacement

    @classmethod
    def _create_transport(cls, host: TransportHost) -> Transport:
        return MultiprocTransport(host, cls.placement_cls, cls.options_cls)
