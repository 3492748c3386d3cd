"""RayTransport: Ray places and watches the workers; the channel carries every call.

Ray keeps what it is good at: placement groups, actor lifecycle, and the death monitor
(``_monitor``). Calls and replies never cross Ray: the workers on the driver's node read each
call from the driver's shared-memory rings (their descriptors handed over a Unix socket,
``executor_channel.handoff``), and the workers on other nodes join the driver's hub over
authenticated TCP (``executor_channel.member``), as ``mp``'s node agents do. So a call is
encoded once (pickle 5, tensors out of band), one wake-up each way on the driver's node, and
every rule of a call is the core's. The driver's side is a
:class:`~executor_channel.driver.ChannelTransport`; this module starts the actors and connects
them to it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import ray

from executor_channel import ChannelTransport, Doorbell, NodeRings
from executor_core import ExecutorClosedError, NodeLostError, WorkerContext, WorkerDiedError
from executor_core.backend import TransportHost, WorkerWrapper, tcp_init_method

from ._cluster import acquire_ray
from ._launch import (
    Startup,
    create_actors,
    hold_lifelines,
    kill_actors,
    raise_failures,
    remove_group,
)
from ._lifeline import DriverLifelines
from ._monitor import DeathMonitor, death_detail
from ._options import RayOptions
from ._placement import reserve_placement_group
from ._ranks import WorkerPlacement, assign_ranks
from ._replace import ActorSlots

# Not typing.TYPE_CHECKING's import cost; type checkers treat any constant of this name as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from executor_channel import Hub

__all__ = ["RayTransport"]

logger = logging.getLogger("executor_plugin_ray")

#: Seconds the graceful part of close may take before the actors are killed.
_GRACEFUL_S = 5.0


class RayTransport(ChannelTransport):
    """Starts one Ray actor per rank in a placement group and connects each to the channel."""

    def __init__(self, host: TransportHost) -> None:
        super().__init__(host)
        config = host.config
        #: The validated ``backend_options`` (validated here, before Ray starts).
        self.options = RayOptions.from_backend_options(config.backend_options)
        #: The actors, in rank order, and where each runs.
        self.actors: list[Any] = []
        self.placements: list[WorkerPlacement] = []
        self._monitor: DeathMonitor | None = None
        self._stopped = threading.Event()
        #: The ranks on the driver's node (served from its rings) and on others (the hub).
        self.ranks_on_rings: tuple[int, ...] = ()
        self.ranks_on_hub: tuple[int, ...] = ()
        #: For rank replacement: the actors' bundles, and every rank's context as its worker
        #: last started or rejoined.
        self._slots: ActorSlots | None = None
        self._contexts: list[WorkerContext] = []
        #: Ranks killed as hung (:meth:`kill`): the core failed their calls already, and
        #: their actor's death is no news (it must not fail a replacement's new host).
        self._killed: set[int] = set()

    # --- start -----------------------------------------------------------------------------

    def start(self) -> None:
        host, options, config = self.host, self.options, self.host.config
        # A recovery's restart hands the Ray connection over (host.kept): releasing the
        # executor's last lease would shut down the Ray instance this process started.
        lease = host.take("ray_lease") or acquire_ray(options, world_size=config.world_size)
        host.keep("ray_lease", lease, lease.release)
        # Where the previous incarnation's ranks ran (a recovery's restart): if one of those
        # nodes is dead and this start fails, no later attempt can do better.
        before: dict[int, str] = host.take("ray_nodes") or {}
        self._check_driver_node(range(config.world_size))
        try:
            self._start()
        except Exception as exc:
            if not isinstance(exc, NodeLostError | ExecutorClosedError):
                gone = _dead_nodes(set(before.values()))
                if gone:
                    node = sorted(gone)[0]
                    raise NodeLostError(
                        node,
                        [rank for rank, where in sorted(before.items()) if where == node],
                        f"the Ray node is dead, and starting the workers again failed: {exc}",
                        "add a node with the resources it held (or give the placement room "
                        "elsewhere), then call recover() or create a new executor",
                    ) from exc
            raise
        host.keep("ray_nodes", {p.rank: p.node_id for p in self.placements}, lambda: None)

    def _check_driver_node(self, ranks: Sequence[int]) -> None:
        """Raise :class:`NodeLostError` if this process's own Ray node is dead (its raylet
        is gone): no actor can be created or reached from here, so no recovery attempt
        could succeed."""
        if ray.util.client.ray.is_connected():  # type: ignore[no-untyped-call]  # unannotated in ray
            return  # Ray Client: this process is on no Ray node
        node = ray.get_runtime_context().get_node_id()
        if _dead_nodes({node}):
            ip = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]  # unannotated in ray
            raise NodeLostError(
                f"{node} ({ip})",
                [p.rank for p in self.placements if p.node_id == node] or list(ranks),
                "it is this driver's own Ray node, and Ray marked it dead (its raylet is "
                "gone): no actor can be created or reached from this process",
                "restart the driver process (and Ray on this machine, if it is a cluster's "
                "node); nothing in this process can bring the executor back",
            )

    def _start(self) -> None:
        host, options, config = self.host, self.options, self.host.config
        # A recovery's restart keeps the placement group too: the new actors go into the same
        # bundles, so every rank comes back on its node.
        group = host.take("ray_group")
        if group is None:
            group, _bundles = reserve_placement_group(options, config.device, config.world_size)
        host.keep("ray_group", group, functools.partial(remove_group, group))
        actors = create_actors(group, options, config)
        host.add_cleanup(functools.partial(kill_actors, actors))
        startup = Startup(options, self._check_running)
        deadline = startup.deadline()
        infos = startup.gather([actor.node_info.remote() for actor in actors], "start", deadline)
        driver_node = ray.get_runtime_context().get_node_id()
        self.placements = placements = assign_ranks(infos, driver_node)
        startup.placements = placements
        self.actors = [actors[p.actor_index] for p in placements]
        monitor = DeathMonitor([actor.watch.remote() for actor in self.actors], self._report_death)
        self._monitor = monitor
        host.add_cleanup(monitor.stop)
        # Before the workers load their model (which may take long): from here on, the
        # actors exit as soon as this process dies, even if Ray does not notice.
        lifelines = DriverLifelines()
        host.add_cleanup(lifelines.close)
        self._slots = ActorSlots(group, actors, list(infos), lifelines, driver_node)
        hold_lifelines(lifelines, self.actors, placements, driver_node, startup, deadline)
        init_method = self._init_method(startup, deadline)
        self._contexts = [
            host.context(
                placement.rank,
                local_rank=placement.local_rank,
                local_world_size=placement.local_world_size,
                node_id=placement.node_id,
                init_method=init_method,
            )
            for placement in placements
        ]
        inits = [
            actor.init_worker.remote(self._wrapper(placement, context))
            for actor, placement, context in zip(
                self.actors, placements, self._contexts, strict=True
            )
        ]
        raise_failures(startup.gather(inits, "init_worker", deadline))
        # Under Ray Client (ray://) this process is on no Ray node: every worker joins the hub.
        on_a_node = not ray.util.client.ray.is_connected()  # type: ignore[no-untyped-call]  # unannotated in ray
        local = [p.rank for p in placements if on_a_node and p.node_id == driver_node]
        remote = [p.rank for p in placements if p.rank not in local]
        self.ranks_on_rings, self.ranks_on_hub = tuple(local), tuple(remote)
        rings = self._attach_local(local, startup, deadline) if local else None
        self.attach_channel(rings, None, None if rings is not None else _new_bell(host))
        driver = self
        if remote:
            driver.hub = self._join_remote(remote, driver, startup, deadline)
        remaining = max(0.0, deadline - time.monotonic())
        driver.wait_until_ready(range(config.world_size), remaining, self._check_start)
        driver.ready()
        if local:  # spares for the ranks a replacement brings back: this node's
            bundle = placements[local[0]].actor_index
            self._slots.start_spares(options, config, bundle, host.add_cleanup)

    def _wrapper(self, placement: WorkerPlacement, context: WorkerContext) -> WorkerWrapper:
        wrapper = self.host.wrapper(context)
        if self.host.config.device == "cuda" and placement.visible_devices is not None:
            # Ray shows each actor only its own GPU; showing the node's workers' GPUs in
            # local-rank order makes cuda:{local_rank} right, as on every other backend.
            wrapper.env.setdefault("CUDA_VISIBLE_DEVICES", placement.visible_devices)
        return wrapper

    def _attach_local(self, ranks: list[int], startup: Startup, deadline: float) -> NodeRings:
        """The rings of the ranks on the driver's node, handed to their actors."""
        rings = NodeRings(len(ranks), self.options.ring_sizes, self.host.add_cleanup)
        self._hand_rings(rings, ranks, startup, deadline)
        return rings

    def _hand_rings(
        self, rings: NodeRings, ranks: Sequence[int], startup: Startup, deadline: float
    ) -> None:
        """Hand ``ranks`` (of :attr:`ranks_on_rings`) their rings, over a Unix socket."""
        from executor_channel._handoff_server import RingHandoff  # Unix sockets: start-up only

        options = self.options
        indices = [self.ranks_on_rings.index(rank) for rank in ranks]
        key = secrets.token_bytes(32)
        handoff = RingHandoff(key, {index: rings.worker_fds(index) for index in indices})
        try:
            refs = [
                self.actors[rank].attach_rings.remote(
                    handoff.address,
                    key,
                    index,
                    rings.layout,
                    options.ring_sizes.spin_s,
                    options.idle_spin_s,
                )
                for index, rank in zip(indices, ranks, strict=True)
            ]
            handoff.serve(deadline, self._check_running)
        finally:
            handoff.close()
        raise_failures(startup.gather(refs, "attach_rings", deadline, ranks))

    def _join_remote(
        self, ranks: list[int], driver: ChannelTransport, startup: Startup, deadline: float
    ) -> Hub:
        """The hub that the ranks on other nodes join, over TCP at this node's IP."""
        from executor_channel import Hub, Listener, Secret  # zmq: only with workers elsewhere

        from . import __version__

        host, options = self.host, self.options
        secret = Secret.generate()  # given to the actors through Ray, never written anywhere
        address = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]  # unannotated in ray
        listener = Listener(secret, host=address)
        host.add_cleanup(listener.close)
        hub = Hub(listener, options.node_timeout_s, driver.reply_bell, driver.report_failure)
        host.add_cleanup(lambda: hub.stop(False, 0.0))
        refs = [
            self.actors[rank].join_hub.remote(
                listener.address,
                secret.key,
                rank,
                __version__,
                options.node_timeout_s,
                max(1.0, deadline - time.monotonic()),
            )
            for rank in ranks
        ]
        hint = (
            f"their Ray actors could not reach this process at {listener.address} (a firewall, "
            "or a driver outside the cluster's network); see the actors' logs"
        )
        hub.join(ranks, __version__, max(0.0, deadline - time.monotonic()), hint)
        placements = self.placements
        for member in hub.nodes:
            rank = member.node_rank
            hub.send_spec(member, placements[rank].node_id, [rank], b"")
        hub.start()
        raise_failures(startup.gather(refs, "join_hub", deadline))
        return hub

    def _init_method(self, startup: Startup, deadline: float) -> str:
        """``tcp://`` on rank 0's node, at a port free there."""
        address = self._rendezvous_host()
        [port] = startup.gather([self.actors[0].free_port.remote(address)], "free_port", deadline)
        return tcp_init_method(address, port)

    def _rendezvous_host(self) -> str:
        """Rank 0's node: the configured host when every rank shares one node (loopback by
        default), rank 0's node IP when they span several."""
        placements = self.placements
        nodes = {p.node_id for p in placements}
        return self.host.config.distributed_host if len(nodes) == 1 else placements[0].node_ip

    def _check_running(self) -> None:
        """Raise if the executor failed or is closing (ends a wait at start)."""
        if self._stopped.is_set():
            host = self.host
            raise (host.closed_error or ExecutorClosedError("the executor was shut down"))

    def _check_start(self, pending: set[int]) -> None:
        self._check_running()

    # --- calls -----------------------------------------------------------------------------

    # --- rank replacement ------------------------------------------------------------------

    def replace(
        self, ranks: Sequence[int], rejoin: Callable[[Sequence[WorkerContext]], None]
    ) -> None:
        driver, monitor, slots = self, self._monitor, self._slots
        assert monitor is not None
        assert slots is not None
        rings, ranks = driver.rings, list(ranks)
        on_hub = [rank for rank in ranks if rank not in self.ranks_on_rings]
        if on_hub or rings is None:
            raise NotImplementedError(
                f"rank(s) {on_hub or ranks} ran on other Ray nodes, as members of the hub, "
                "which admits members only at start: only ranks on the driver's node are "
                "replaced"
            )
        host, options = self.host, self.options
        self._check_driver_node(ranks)
        self._stopped.clear()  # undo interrupt()
        driver.resume()
        if host.closed_error is not None:  # shut down before interrupt() was undone
            raise host.closed_error
        startup = Startup(options, self._check_running)
        startup.placements = self.placements
        deadline = startup.deadline()
        fresh = slots.replace(self.placements, ranks, options, host.config, startup, deadline)
        for rank, actor in zip(ranks, fresh, strict=True):
            self.actors[rank] = actor
            monitor.watch(rank, actor.watch.remote())
            self._killed.discard(rank)  # after the swap: the old actor's watch is gone
        # Rank 0 is on this node (the driver's node's ranks come first): a port free here.
        init_method = host.rendezvous(self._rendezvous_host())
        contexts = [
            attrs.evolve(context, distributed_init_method=init_method) for context in self._contexts
        ]
        for rank in ranks:  # the new actor reads from the next call written: the rejoin
            rings.resume_worker(self.ranks_on_rings.index(rank))
        inits = [
            actor.init_worker.remote(self._wrapper(self.placements[rank], contexts[rank]))
            for rank, actor in zip(ranks, fresh, strict=True)
        ]
        # Sent now, not once the new ranks loaded: a new rank's init_device may wait at the
        # new rendezvous for the survivors, which meet it there in their rejoin.
        rejoin(contexts)
        raise_failures(startup.gather(inits, "init_worker", deadline, ranks))
        self._hand_rings(rings, ranks, startup, deadline)
        driver.wait_until_ready(ranks, max(0.0, deadline - time.monotonic()), self._check_start)
        self._contexts = contexts

    # --- failures --------------------------------------------------------------------------

    def _report_death(self, rank: int, error: BaseException) -> None:
        """``rank``'s actor (or its node) is gone: fail the executor with the rank, where it
        ran and Ray's reason. Called by the monitor. Only the executor fails: a recovery
        replaces the dead rank (the survivors live on) or restarts every rank, and without
        a policy the survivors stop at shutdown."""
        if rank in self._killed:  # declared hung: the core failed its calls already
            return
        placements = self.placements
        placement = placements[rank] if 0 <= rank < len(placements) else None
        died = WorkerDiedError(rank, detail=death_detail(placement, error))
        self.host.worker_died(died)
        if self.host.closed_error is died:
            logger.error("%s", died)

    def probe(self, ranks: Sequence[int], timeout: float) -> set[int]:
        asked = {self.actors[rank].alive.remote(): rank for rank in ranks}
        ready, _ = ray.wait(list(asked), num_returns=len(asked), timeout=timeout)
        answered = set()
        for ref in ready:  # a dead actor's call is ready too, with its death as the error
            try:
                ray.get(ref, timeout=0)
            except Exception:  # noqa: BLE001 - any failure of the call: the rank is gone
                continue
            answered.add(asked[ref])
        return {rank for rank in asked.values() if rank not in answered}

    def kill(self, ranks: Sequence[int]) -> None:
        self._killed.update(ranks)
        for rank in ranks:
            if rank in self.ranks_on_rings:
                # On this machine, frozen (its pid its own): Ray's kill waits seconds for it
                # to exit, and a rank replacement for its bundle.
                with contextlib.suppress(OSError):
                    os.kill(self.placements[rank].pid, signal.SIGKILL)
            ray.kill(self.actors[rank], no_restart=True)

    def interrupt(self) -> None:
        self._stopped.set()
        super().interrupt()

    # --- close -----------------------------------------------------------------------------

    def close(self, graceful: bool) -> None:
        """(Graceful) stop the workers' loops and let each worker run its shutdown. Killing
        the actors, removing the placement group and releasing Ray are cleanups, which the
        finalizer runs too."""
        self._stopped.set()
        monitor = self._monitor
        if monitor is not None:
            monitor.stop()
        graceful = graceful and self.attached and not self.aborted
        if self.attached:
            if graceful:
                self.send_stop(_GRACEFUL_S)
            self.stop_hub(graceful, _GRACEFUL_S)
        actors = self.actors
        if graceful and actors and ray.is_initialized():
            try:
                refs = [actor.shutdown.remote() for actor in actors]
                ray.wait(refs, num_returns=len(refs), timeout=_GRACEFUL_S)
            except ray.exceptions.RayError:
                logger.debug("graceful shutdown of the Ray workers failed", exc_info=True)


def _new_bell(host: TransportHost) -> Doorbell:
    bell = Doorbell(blocking=True)
    host.add_cleanup(bell.close)
    return bell


def _dead_nodes(node_ids: set[str]) -> set[str]:
    """Those of ``node_ids`` that Ray's control store does not list as alive (one call to
    the GCS, which answers while a node's raylet is gone)."""
    if not node_ids:
        return set()
    nodes = ray.nodes()  # type: ignore[no-untyped-call]  # unannotated in ray
    alive = {node["NodeID"] for node in nodes if node.get("Alive")}
    return node_ids - alive
