"""RayTransport: Ray places, starts and watches the workers; the channel carries every call.

Ray keeps placement groups, the actors' lifecycle and the death monitor (``_monitor``). The
workers on the driver's node read each call from its shared-memory rings (the descriptors sent
over each actor's lifeline, ``_lifeline``); those on other nodes join its hub over
authenticated TCP (``executor_channel.MemberServer``). Every wait at start is bounded by
``startup_timeout`` and ends early when the executor fails or closes meanwhile.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import PlacementGroup, remove_placement_group

from executor_channel import ChannelTransport, Doorbell, NodeRings
from executor_core import (
    ExecutorClosedError,
    ExecutorError,
    NodeLostError,
    WorkerContext,
    WorkerDiedError,
    WorkerError,
)
from executor_core.backend import TransportHost, WorkerWrapper, tcp_init_method

from ._actor import Failed, create_actor
from ._cluster import acquire_ray
from ._lifeline import HOLD_S, Address, DriverLifelines
from ._monitor import DeathMonitor, death_detail
from ._options import RayOptions
from ._placement import ActorInfo, WorkerPlacement, assign_ranks, reserve_placement_group
from ._spare import Spares, spares_wanted

# Not typing.TYPE_CHECKING's import cost; type checkers treat any constant of this name as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from executor_channel import Hub

__all__ = ["RayTransport", "kill_actors"]

logger = logging.getLogger("executor_plugin_ray")

#: Seconds the graceful part of close may take before the actors are killed.
_GRACEFUL_S = 5.0
#: Longest uninterrupted wait on Ray at start; between slices the executor's state is checked.
_SLICE_S = 0.5


def _client() -> bool:
    """Under Ray Client (``ray://``) this process is on no Ray node (and not the job's driver)."""
    return bool(ray.util.client.ray.is_connected())  # type: ignore[no-untyped-call]  # unannotated


def _node_ip() -> str:
    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]  # unannotated


class RayTransport(ChannelTransport):
    """Starts one Ray actor per rank in a placement group and connects each to the channel."""

    def __init__(self, host: TransportHost) -> None:
        super().__init__(host)
        #: The validated ``backend_options`` (validated here, before Ray starts).
        self.options = RayOptions.from_backend_options(host.config.backend_options)
        #: The actors, in rank order, and where each runs.
        self.actors: list[Any] = []
        self.placements: list[WorkerPlacement] = []
        #: The ranks on the driver's node (served from its rings) and on others (the hub).
        self.ranks_on_rings: tuple[int, ...] = ()
        self.ranks_on_hub: tuple[int, ...] = ()
        self._monitor: DeathMonitor | None = None
        self._stopped = threading.Event()
        #: For rank replacement: the actors in bundle order (the start's cleanup kills this
        #: very list, replacements included), what each reported at start, every rank's
        #: context as its worker last started, the lifelines and the spares.
        self._group: PlacementGroup | None = None
        self._created: list[Any] = []
        self._infos: list[ActorInfo] = []
        self._contexts: list[WorkerContext] = []
        self._lifelines = DriverLifelines()
        self._unix: Address | None = None
        self._spares: Spares | None = None
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
            final = isinstance(exc, NodeLostError | ExecutorClosedError)
            gone = set() if final else _dead_nodes(set(before.values()))
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
        is gone): no actor can be created or reached from here, nor any recovery succeed."""
        if _client():
            return
        node = ray.get_runtime_context().get_node_id()
        if _dead_nodes({node}):
            raise NodeLostError(
                f"{node} ({_node_ip()})",
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
            group = reserve_placement_group(options, config.device, config.world_size)
        host.keep("ray_group", group, functools.partial(_remove_group, group))
        self._group = group
        self._created = actors = [
            create_actor(group, index, options, config) for index in range(config.world_size)
        ]
        host.add_cleanup(functools.partial(kill_actors, actors))
        host.add_cleanup(self._lifelines.close)
        deadline = time.monotonic() + options.startup_timeout
        self._infos = self._gather(
            [actor.node_info.remote() for actor in actors], "start", deadline
        )
        driver_node = "" if _client() else ray.get_runtime_context().get_node_id()
        self.placements = placements = assign_ranks(self._infos, driver_node)
        self.actors = [actors[p.actor_index] for p in placements]
        self._monitor = DeathMonitor([a.watch.remote() for a in self.actors], self._report_death)
        host.add_cleanup(self._monitor.stop)
        local = tuple(p.rank for p in placements if p.node_id == driver_node)
        remote = tuple(p.rank for p in placements if p.rank not in local)
        self.ranks_on_rings, self.ranks_on_hub = local, remote
        # Before the workers load their model (which may take long): from here on, the
        # actors exit as soon as this process dies, even if Ray does not notice.
        if local:  # kept listening: a replacement's new actor and the spares connect later
            self._unix = self._lifelines.listen(None)
            self._hold_lifelines(local, self._unix, deadline)
        if remote and not _client():  # the job's driver is then Ray's client server
            address = self._lifelines.listen(_node_ip())
            self._hold_lifelines(remote, address, deadline)
            self._lifelines.stop_listening(keep_unix=True)
        init_method = self._init_method(deadline)
        self._contexts = [
            host.context(
                p.rank,
                local_rank=p.local_rank,
                local_world_size=p.local_world_size,
                node_id=p.node_id,
                init_method=init_method,
            )
            for p in placements
        ]
        inits = [
            actor.init_worker.remote(self._wrapper(rank, self._contexts[rank]))
            for rank, actor in enumerate(self.actors)
        ]
        _raise_failures(self._gather(inits, "init_worker", deadline))
        rings = None
        if local:
            rings = NodeRings(len(local), options.ring_sizes, host.add_cleanup)
            self.attach_channel(rings, None, None)
            self._hand_rings(local, deadline)
        else:
            bell = Doorbell(blocking=True)
            host.add_cleanup(bell.close)
            self.attach_channel(None, None, bell)
        if remote:
            self.hub = self._join_remote(remote, deadline)
        remaining = max(0.0, deadline - time.monotonic())
        self.wait_until_ready(range(config.world_size), remaining, self._check_start)
        self.ready()
        if local and self._unix is not None and spares_wanted(options, config):
            bundle = placements[local[0]].actor_index  # this node's ranks are replaced
            lifeline = (self._unix, self._lifelines.key)
            self._spares = Spares(group, bundle, options, config, lifeline)
            host.add_cleanup(self._spares.close)
            self._spares.top_up()

    def _wrapper(self, rank: int, context: WorkerContext) -> WorkerWrapper:
        wrapper = self.host.wrapper(context)
        visible = self.placements[rank].visible_devices
        if self.host.config.device == "cuda" and visible is not None:
            # Ray shows each actor only its own GPU; showing the node's workers' GPUs in
            # local-rank order makes cuda:{local_rank} right, as on every other backend.
            wrapper.env.setdefault("CUDA_VISIBLE_DEVICES", visible)
        return wrapper

    def _hold_lifelines(self, ranks: Sequence[int], address: Address, deadline: float) -> None:
        """Have the actors of ``ranks`` connect their lifeline to ``address``. Those on
        other nodes that cannot are logged and go on without one."""
        timeout_s = min(HOLD_S, max(1.0, deadline - time.monotonic()))
        key = self._lifelines.key
        refs = [self.actors[rank].hold_lifeline.remote(address, key, timeout_s) for rank in ranks]
        failed = {
            rank: why
            for rank, why in zip(
                ranks, self._gather(refs, "hold_lifeline", deadline, ranks), strict=True
            )
            if why is not None
        }
        if failed and isinstance(address, str):  # on this node: no rings without one
            raise ExecutorError(f"Ray workers {sorted(failed)} hold no lifeline: {failed}")
        if failed:
            logger.warning(
                "Ray workers %s hold no lifeline to the driver at %r (%s): if this process is "
                "killed, they live on until Ray ends the job",
                sorted(failed),
                address,
                "; ".join(sorted(set(failed.values()))),
            )

    def _hand_rings(self, ranks: Sequence[int], deadline: float) -> None:
        """Send ``ranks`` (of :attr:`ranks_on_rings`) their rings' descriptors over their
        lifelines, and have them attach."""
        rings, options = self.rings, self.options
        assert rings is not None
        refs = []
        for rank in ranks:
            index = self.ranks_on_rings.index(rank)
            self._lifelines.send_fds(self.placements[rank].pid, rings.worker_fds(index).as_tuple())
            refs.append(
                self.actors[rank].attach_rings.remote(
                    index, rings.layout, options.ring_sizes.spin_s, options.idle_spin_s
                )
            )
        _raise_failures(self._gather(refs, "attach_rings", deadline, ranks))

    def _join_remote(self, ranks: Sequence[int], deadline: float) -> Hub:
        """The hub that the ranks on other nodes join, over TCP at this node's IP."""
        from executor_channel import Hub, Listener, Secret  # zmq: only with workers elsewhere

        from . import __version__

        host, options = self.host, self.options
        secret = Secret.generate()  # given to the actors through Ray, never written anywhere
        listener = Listener(secret, host=_node_ip())
        host.add_cleanup(listener.close)
        hub = Hub(listener, options.node_timeout_s, self.reply_bell, self.report_failure)
        host.add_cleanup(lambda: hub.stop(False, 0.0))
        join_s = max(1.0, deadline - time.monotonic())
        refs = [
            self.actors[rank].join_hub.remote(
                listener.address, secret.key, rank, __version__, options.node_timeout_s, join_s
            )
            for rank in ranks
        ]
        hint = (
            f"their Ray actors could not reach this process at {listener.address} (a firewall, "
            "or a driver outside the cluster's network); see the actors' logs"
        )
        hub.join(ranks, __version__, max(0.0, deadline - time.monotonic()), hint)
        for member in hub.nodes:
            rank = member.node_rank
            hub.send_spec(member, self.placements[rank].node_id, [rank], b"")
        hub.start()
        _raise_failures(self._gather(refs, "join_hub", deadline))
        return hub

    def _init_method(self, deadline: float) -> str:
        """``tcp://`` on rank 0's node, at a port free there."""
        address = self._rendezvous_host()
        [port] = self._gather([self.actors[0].free_port.remote(address)], "free_port", deadline)
        return tcp_init_method(address, port)

    def _rendezvous_host(self) -> str:
        """Rank 0's node: the configured host when every rank shares one node (loopback by
        default), rank 0's node IP when they span several."""
        placements = self.placements
        if len({p.node_id for p in placements}) == 1:
            return self.host.config.distributed_host
        return placements[0].node_ip

    def _check_running(self) -> None:
        """Raise if the executor failed or is closing (ends a wait at start)."""
        if self._stopped.is_set():
            raise self.host.closed_error or ExecutorClosedError("the executor was shut down")

    def _check_start(self, pending: set[int]) -> None:
        self._check_running()

    def _gather(
        self, refs: Sequence[Any], what: str, deadline: float, ranks: Sequence[int] | None = None
    ) -> list[Any]:
        """One reply per ref (the i-th from rank ``ranks[i]``; by default rank or actor
        ``i``). Raises :class:`WorkerDiedError` if an actor died, :class:`WorkerError` if its
        call failed in Ray, :class:`ExecutorError` after the deadline (naming the late
        ranks)."""
        refs, named = list(refs), list(range(len(refs)) if ranks is None else ranks)
        while True:
            remaining = deadline - time.monotonic()
            try:
                return list(ray.get(refs, timeout=max(0.0, min(_SLICE_S, remaining))))
            except GetTimeoutError:
                pass
            except RayError as exc:
                raise self._diagnose(refs, named, what, exc) from None
            self._check_running()
            if remaining <= _SLICE_S:
                done = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
                late = [rank for rank, ref in zip(named, refs, strict=True) if ref not in done]
                raise ExecutorError(
                    f"Ray workers {late} did not finish {what!r} within "
                    f"startup_timeout={self.options.startup_timeout:g} s; raise "
                    "backend_options['startup_timeout'] if loading the model takes longer"
                )

    def _diagnose(
        self, refs: Sequence[Any], ranks: Sequence[int], what: str, exc: RayError
    ) -> ExecutorError:
        for rank, ref in zip(ranks, refs, strict=True):
            try:
                ray.get(ref, timeout=0)
            except GetTimeoutError:
                continue
            except RayActorError as err:
                return WorkerDiedError(rank, detail=death_detail(self._placement(rank), err))
            except RayTaskError as err:
                return WorkerError(rank, what, type(err.cause).__name__, str(err.cause), str(err))
            except RayError as err:
                return WorkerError(rank, what, type(err).__name__, str(err), str(err))
        return ExecutorError(f"Ray failed during {what!r}: {exc}")

    def _placement(self, rank: int) -> WorkerPlacement | None:
        return self.placements[rank] if 0 <= rank < len(self.placements) else None

    # --- rank replacement ------------------------------------------------------------------

    def replace(
        self, ranks: Sequence[int], rejoin: Callable[[Sequence[WorkerContext]], None]
    ) -> None:
        """A new actor for each dead rank in the dead one's bundle (a bundle stays on its
        node, so the rank keeps its place, GPU and local rank), or a warm spare; it takes
        the same rings. Only ranks on the driver's node: the hub admits members only at
        start, so a death elsewhere restarts the group (``NotImplementedError``)."""
        monitor, rings, ranks = self._monitor, self.rings, list(ranks)
        assert monitor is not None
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
        self.resume()
        if host.closed_error is not None:  # shut down before interrupt() was undone
            raise host.closed_error
        deadline = time.monotonic() + options.startup_timeout
        fresh = self._new_actors(ranks, deadline)
        for rank, actor in zip(ranks, fresh, strict=True):
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
            actor.init_worker.remote(self._wrapper(rank, contexts[rank]))
            for rank, actor in zip(ranks, fresh, strict=True)
        ]
        # Sent now, not once the new ranks loaded: a new rank's init_device may wait at the
        # new rendezvous for the survivors, which meet it there in their rejoin.
        rejoin(contexts)
        _raise_failures(self._gather(inits, "init_worker", deadline, ranks))
        self._hand_rings(ranks, deadline)
        self.wait_until_ready(ranks, max(0.0, deadline - time.monotonic()), self._check_start)
        self._contexts = contexts

    def _new_actors(self, ranks: Sequence[int], deadline: float) -> list[Any]:
        """New actors for ``ranks`` in their dead actors' bundles, holding a lifeline;
        :attr:`placements` gets their pids. :class:`ExecutorError` if one landed on another
        node or GPU (its bundle moved with a lost node: the group restarts)."""
        assert self._group is not None
        fresh, started, placements = [], [], self.placements
        for rank in ranks:
            index = placements[rank].actor_index
            # Dead already, or as good as (killed as hung): its bundle must be free first.
            kill_actors([self._created[index]])
            actor = self._spares.take() if self._spares is not None else None
            if actor is None:
                actor = create_actor(self._group, index, self.options, self.host.config)
                started.append(rank)
            self._created[index] = actor
            fresh.append(actor)
        infos = self._gather([a.node_info.remote() for a in fresh], "node_info", deadline, ranks)
        for rank, actor, info in zip(ranks, fresh, infos, strict=True):
            placement = placements[rank]
            before = self._infos[placement.actor_index]
            if rank not in started:  # a spare: asked Ray for no GPU, it uses the rank's
                info = attrs.evolve(info, gpu_ids=before.gpu_ids)
            if (info.node_id, info.gpu_ids) != (before.node_id, before.gpu_ids):
                raise ExecutorError(
                    f"the new Ray actor of rank {rank} landed on node {info.node_id} (GPUs "
                    f"{list(info.gpu_ids)}), not where rank {rank} ran (node "
                    f"{before.node_id}, GPUs {list(before.gpu_ids)})"
                )
            self._infos[placement.actor_index] = info
            placements[rank] = attrs.evolve(placement, pid=info.pid)
            self.actors[rank] = actor
        if started and self._unix is not None:  # a spare holds its lifeline already
            self._hold_lifelines(started, self._unix, deadline)
        self._lifelines.prune()  # the dead actors' ends are closed by now: close this one
        if self._spares is not None:
            self._spares.top_up()
        return fresh

    # --- failures --------------------------------------------------------------------------

    def _report_death(self, rank: int, error: BaseException) -> None:
        """``rank``'s actor (or its node) is gone: fail the executor with the rank, where it
        ran and Ray's reason. Called by the monitor. A recovery replaces the dead rank or
        restarts every rank; without a policy the survivors stop at shutdown."""
        if rank in self._killed:  # declared hung: the core failed its calls already
            return
        died = WorkerDiedError(rank, detail=death_detail(self._placement(rank), error))
        self.host.worker_died(died)
        if self.host.closed_error is died:
            logger.error("%s", died)

    def probe(self, ranks: Sequence[int], timeout: float) -> set[int]:
        asked = {self.actors[rank].alive.remote(): rank for rank in ranks}
        ready, _ = ray.wait(list(asked), num_returns=len(asked), timeout=timeout)
        answered = set()
        for ref in ready:  # a dead actor's call is ready too, with its death as the error
            with contextlib.suppress(Exception):
                ray.get(ref, timeout=0)
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
        if self._monitor is not None:
            self._monitor.stop()
        graceful = graceful and self.attached and not self.aborted
        if self.attached:
            if graceful:
                self.send_stop(_GRACEFUL_S)
            self.stop_hub(graceful, _GRACEFUL_S)
        if graceful and self.actors and ray.is_initialized():
            try:
                refs = [actor.shutdown.remote() for actor in self.actors]
                ray.wait(refs, num_returns=len(refs), timeout=_GRACEFUL_S)
            except RayError:
                logger.debug("graceful shutdown of the Ray workers failed", exc_info=True)


def _raise_failures(replies: Sequence[Any]) -> None:
    """Raise the error of the lowest rank whose reply is a :class:`Failed`."""
    for reply in replies:
        if isinstance(reply, Failed):
            raise reply.failure.to_error()


def kill_actors(actors: Sequence[Any]) -> None:
    """Kill the actors (a cleanup: whatever is already gone is skipped)."""
    if not ray.is_initialized():
        return
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already dead or Ray gone: nothing left to kill
            logger.debug("ray.kill failed", exc_info=True)


def _remove_group(group: PlacementGroup) -> None:
    """Remove the placement group (a cleanup)."""
    if ray.is_initialized():
        with contextlib.suppress(Exception):  # already removed or Ray gone
            remove_placement_group(group)


def _dead_nodes(node_ids: set[str]) -> set[str]:
    """Those of ``node_ids`` that Ray's control store does not list as alive (one call to
    the GCS, which answers while a node's raylet is gone)."""
    if not node_ids:
        return set()
    nodes = ray.nodes()  # type: ignore[no-untyped-call]  # unannotated in ray
    return node_ids - {node["NodeID"] for node in nodes if node.get("Alive")}
