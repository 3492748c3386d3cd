"""MultiprocTransport: the ``mp`` backend's side of the core's Transport contract.

It starts one worker process per rank, writes each call once into the broadcast ring and
reads the replies from the reply rings in :meth:`MultiprocTransport.poll`, which the core
calls from the thread that waits (``polls = True``: no thread hop per call). Everything else
about a call (ordering, reply gathering, timeouts, failure) is the core's.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence

import attrs

from executor_channel import ChannelTransport, Doorbell, NodeRings
from executor_core import (
    ConfigError,
    ExecutorError,
    ExecutorFailedError,
    WorkerContext,
    WorkerDiedError,
)
from executor_core.backend import TransportHost, tcp_init_method

from ._group import WorkerGroup
from ._local import WorkerLaunch, check_devices, replace_workers, start_workers
from ._node_protocol import NodeSpec
from ._options import MultiprocOptions
from ._placing import join_nodes, placement_for, remember_lost
from ._process import worker_died_error
from ._spare import worker_qualname
from .launcher import ManualPlacement, Placement

__all__ = ["MultiprocTransport"]


class MultiprocTransport(ChannelTransport):
    """One worker process per rank on this machine, fed through shared-memory rings.

    A call is written once into a broadcast ring that every worker reads; each worker answers
    through its own reply ring. Waits spin briefly (``spin_s``), then sleep on an eventfd, so
    idle processes use no CPU. A monitor thread (:class:`WorkerGroup`) reports a worker's
    death to the core, which fails every call in flight and every later one.
    """

    def __init__(
        self,
        host: TransportHost,
        placement_cls: type[Placement] = ManualPlacement,
        options_cls: type[MultiprocOptions] = MultiprocOptions,
    ) -> None:
        super().__init__(host)
        self._placement_cls = placement_cls
        #: The executor's options class: mp's, or a backend's subclass with keys of its own.
        self._options_cls = options_cls
        self._options: MultiprocOptions | None = None
        self._group: WorkerGroup | None = None
        #: Ranks on this node (0 .. _local - 1); 0 where the driver runs no ranks.
        self._local = 0
        #: Every rank's context, as its worker last started or rejoined.
        self._contexts: list[WorkerContext] = []
        #: Ranks killed as hung (:meth:`kill`): their death is not news to the core.
        self._killed: set[int] = set()
        self._placement: Placement | None = None

    # --- start-up ----------------------------------------------------------------------

    def start(self) -> None:
        host = self.host
        config = host.config
        options = self._options_cls.from_backend_options(config.backend_options)
        self._options = options
        per_node = _ranks_per_node(config.world_size, config.num_nodes)
        placement = None
        if config.num_nodes > 1:
            placement = placement_for(host, self._placement_cls, options)
        local = per_node if placement is None or placement.driver_runs_ranks else 0
        if local:
            check_devices(options, config.device, per_node, host.worker_env)
            channel: NodeRings | None = NodeRings(per_node, options.ring_sizes, host.add_cleanup)
            self.attach_channel(channel)
        else:  # every rank on placed nodes: the hub's doorbell wakes the driver
            channel = None
            bell = Doorbell()
            host.add_cleanup(bell.close)
            self.attach_channel(None, reply_bell=bell)
        self._local = local
        nodes = None
        if placement is None:
            contexts = host.contexts()
        else:
            nodes = join_nodes(
                host, placement, options, self.reply_bell, self._remote_failure, local
            )
            members = nodes.nodes
            node_ids = [placement.node_id()] * bool(local) + [node.node_id for node in members]
            if len(set(node_ids)) < len(node_ids):  # several agents on one machine
                node_ids = [f"{name}#{i}" for i, name in enumerate(node_ids)]
            for node, node_id in zip(members, node_ids[bool(local) :], strict=True):
                node.node_id = node_id
            init_method = None
            if not local:  # node 0's agent hosts the rendezvous, where it said it is
                first = members[0]
                if not first.address or not first.port:
                    raise ExecutorError(
                        f"node {first.describe()} gave no address and free port for the torch "
                        "rendezvous: start its agent with --address ADDRESS"
                    )
                init_method = tcp_init_method(first.address, first.port)
            contexts = host.contexts(
                [node_ids[rank // per_node] for rank in range(config.world_size)],
                init_method,
                {node.node_id: node.address for node in members},
            )
        self._contexts = list(contexts)
        launches = [WorkerLaunch.of(host.wrapper(context), config.env) for context in contexts]
        spares = options.spare_workers if config.recovery is not None else 0
        preload = (worker_qualname(config.worker_cls),)
        group = None
        if channel is not None:
            group = start_workers(
                channel,
                launches[:per_node],
                options,
                host.add_cleanup,
                self._on_worker_death,
                spares,
                preload,
            )
        self._group = group
        if nodes is not None:
            for node in nodes.nodes:
                first_rank = node.node_rank * per_node
                spec = NodeSpec(
                    node_rank=node.node_rank,
                    node_id=node.node_id,
                    launches=tuple(launches[first_rank : first_rank + per_node]),
                    options=options,
                    device=config.device,
                    worker_env=host.worker_env,
                    spares=spares,
                    preload=preload,
                )
                ranks = range(first_rank, first_rank + per_node)
                nodes.send_spec(node, spec.node_id, ranks, pickle.dumps(spec, protocol=5))
            nodes.start()
            self.hub = nodes
        self.wait_until_ready(range(config.world_size), options.startup_timeout, self._check_start)
        if group is not None:
            group.armed = True
        self.ready()
        if group is not None:
            group.start_spares()
        if placement is not None:
            placement._report_lost = self._agent_lost
        self._placement = placement
        # A worker may have died between its handshake and arming the monitor.
        for rank in range(local):
            assert group is not None
            code = group.exit_code(rank)
            if code is not None:
                raise worker_died_error(rank, code, "right after start-up")

    def _check_start(self, pending: set[int]) -> None:
        """Between waits for the ready frames: a local worker that died ends the start."""
        group = self._group
        for rank in sorted(pending):
            if rank >= self._local or group is None:
                continue
            code = group.exit_code(rank)
            if code is not None and not self._channel_rings().replies[rank].poll():
                raise worker_died_error(rank, code, "during start-up; its stderr has the details")

    def _channel_rings(self) -> NodeRings:
        assert self.rings is not None  # the driver's node always runs ranks
        return self.rings

    # --- calls -------------------------------------------------------------------------

    def probe(self, ranks: Sequence[int], timeout: float) -> set[int]:
        # The remote ranks' agents are asked first, and answer while the local ranks are.
        hub, group = self.hub, self._group
        remote = [rank for rank in ranks if rank >= self._local]
        wait_remote = hub.probe(remote, timeout) if hub is not None and remote else None
        local = [rank for rank in ranks if rank < self._local]
        silent = group.probes.probe(local, timeout) if group is not None and local else set()
        return silent | (wait_remote() if wait_remote is not None else set())

    def kill(self, ranks: Sequence[int]) -> None:
        self._killed.update(ranks)
        if self._group is not None:
            self._group.kill([rank for rank in ranks if rank < self._local])
        remote = [rank for rank in ranks if rank >= self._local]
        if self.hub is not None and remote:
            self.hub.end(remote)

    # --- rank replacement ------------------------------------------------------------------

    def replace(
        self, ranks: Sequence[int], rejoin: Callable[[Sequence[WorkerContext]], None]
    ) -> None:
        driver, group, options = self, self._group, self._options
        assert options is not None
        if group is None:
            # The rendezvous is on node 0's agent, at the port it chose for the first one:
            # a new one there is not built; the core restarts every rank.
            raise NotImplementedError("the driver runs no ranks: every rank is restarted")
        host = self.host
        config = host.config
        driver.resume()
        # A new rendezvous on this host, as at start (the driver's node hosts it).
        init_method = host.rendezvous()
        contexts = [
            attrs.evolve(context, distributed_init_method=init_method) for context in self._contexts
        ]
        launches = {
            rank: WorkerLaunch.of(host.wrapper(contexts[rank]), config.env) for rank in ranks
        }
        remote = [rank for rank in ranks if rank >= self._local]
        for node in driver.hub.nodes if driver.hub is not None else []:
            if node.lost and set(node.ranks) & set(remote):
                # Its agent is gone, and a hub admits agents only while it starts: the group
                # restart waits for one to join again (start_nodes names the node if none).
                raise ExecutorError(
                    f"the agent of node {node.node_id} (node rank {node.node_rank}, ranks "
                    f"{list(node.ranks)}) is gone, so its ranks cannot be replaced where they "
                    f"ran; the group restart waits up to startup_timeout="
                    f"{options.startup_timeout:g} s for an agent of node rank "
                    f"{node.node_rank} to join again"
                )
        if remote:
            # Their agents start them, in order with the calls (the stale ones before).
            assert driver.hub is not None
            payload = pickle.dumps(tuple(launches[rank] for rank in remote), protocol=5)
            driver.hub.replace(remote, payload)
        local = [launches[rank] for rank in ranks if rank < self._local]
        failed = replace_workers(self._channel_rings(), group, local, 0)
        if failed:
            rank, exc = failed[0]
            raise ExecutorError(f"rank {rank} could not be started again: {exc}") from exc
        self._killed.difference_update(ranks)
        rejoin(contexts)
        driver.wait_until_ready(ranks, options.startup_timeout, self._check_start)
        self._contexts = contexts

    # --- failure and stop ------------------------------------------------------------------

    def _agent_lost(self, node_rank: int, detail: str) -> None:
        """``Placement.agent_lost``: the scheduler ended that node's agent."""
        hub = self.hub
        for node in hub.nodes if hub is not None else []:
            if node.node_rank == node_rank:
                hub.lose(node, detail)  # type: ignore[union-attr]  # not None here

    def _remote_failure(self, error: ExecutorFailedError) -> None:
        """The hub's pump: a remote worker or node is gone (a rank killed as hung is not
        news: the core failed its calls already)."""
        ranks = getattr(error, "ranks", None)
        if isinstance(error, WorkerDiedError) and ranks and set(ranks) <= self._killed:
            return
        self.report_failure(error)

    def _on_worker_death(self, rank: int, exitcode: int) -> None:
        """Monitor thread: a worker ended while the executor was running."""
        if rank in self._killed:  # declared hung: the core failed its calls already
            return
        self.host.worker_died(worker_died_error(rank, exitcode, ""))
        group, options = self._group, self._options
        if group is not None and options is not None and self.host.config.recovery is None:
            # Fail-stop: the survivors go now (with a policy they may rejoin, or the group
            # restart stops them).
            group.terminate(options.shutdown_grace_s)

    def close(self, graceful: bool) -> None:
        group, options, driver = self._group, self._options, self
        if options is None or not driver.attached:
            return  # start-up failed before any process was made
        if self._placement is not None:
            self._placement._report_lost = None
        if group is not None:
            group.closing = True
        if graceful and driver.is_ready and not driver.aborted:
            driver.send_stop(options.shutdown_grace_s)
            if group is not None:
                group.stop(options.shutdown_grace_s, options.shutdown_grace_s)
            driver.stop_hub(True, options.shutdown_grace_s)
        else:
            # A recovery: agents someone else started join the next incarnation (placed
            # ones are started anew by their placement).
            rejoin = self.host.restarting and self._placement_cls.agents_rejoin
            if self.host.restarting and driver.hub is not None:
                remember_lost(self.host, driver.hub)
            driver.stop_hub(False, 0.0, rejoin)
            if group is not None:
                group.kill_now()


def _ranks_per_node(world_size: int, num_nodes: int) -> int:
    if world_size % num_nodes:
        raise ConfigError(
            "num_nodes",
            num_nodes,
            f"the mp backend puts the same number of ranks on every node, and world_size="
            f"{world_size} is not a multiple of num_nodes={num_nodes}",
        )
    return world_size // num_nodes
