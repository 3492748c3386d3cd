"""RayExecutor: one Ray actor per rank, in a placement group, on one node or many."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import ray
from ray.exceptions import (
    GetTimeoutError,
    RayActorError,
    RayChannelTimeoutError,
    RayError,
    RayTaskError,
)
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from executor_core import (
    ConfigError,
    Executor,
    ExecutorClosedError,
    ExecutorError,
    ExecutorFailedError,
    RPCTimeoutError,
    WorkerContext,
    WorkerDiedError,
    WorkerError,
    dumps_method,
    method_name,
    tcp_init_method,
)

from ._actor import RayWorkerActor
from ._cluster import acquire_ray
from ._compiled import CompiledStep, compiled_graphs_available, max_inflight_steps
from ._direct import ChannelClosedError, DirectChannels
from ._encoding import Failed, decode_reply, pack
from ._monitor import DeathMonitor
from ._options import RayOptions
from ._placement import bundle_for, reserve_placement_group
from ._ranks import ActorInfo, WorkerPlacement, assign_ranks

__all__ = ["RayExecutor"]

logger = logging.getLogger("executor_plugin_ray")

#: Longest uninterrupted wait on Ray; between slices a waiter notices failure or shutdown.
_WAIT_SLICE_S = 0.5
#: Arguments at least this large cross as arguments of their own, put into the object store
#: once for all workers rather than serialised once per worker (Ray inlines smaller ones).
_LIFT_BYTES = 100 * 1024
#: Longest wait for a worker's direct channel to accept the driver (it takes milliseconds).
_CONNECT_S = 30.0
#: Seconds the graceful part of shutdown may take before the actors are killed.
_GRACEFUL_S = 5.0


class RayExecutor(Executor):
    """Runs each rank's worker in a Ray actor; see the distribution's README for options.

    Small calls go on the executor's own socket to each worker when all are on the driver's
    node, or on any node with ``direct_calls_across_nodes`` (``_direct``), and as Ray actor
    tasks (one per rank, in order) otherwise. With
    ``compiled_graph`` enabled ``execute_model`` goes through a Ray Compiled Graph. A monitor
    fails the executor with :class:`WorkerDiedError` (rank and node) as soon as Ray reports an
    actor or its node dead; pending and later calls then raise that error.
    """

    supports_pp = True
    uses_ray = True

    # --- start -----------------------------------------------------------------------------

    def _init_executor(self) -> None:
        config = self.config
        self._options = options = RayOptions.from_backend_options(config.backend_options)
        if config.device not in ("cpu", "cuda"):
            raise ConfigError("device", config.device, "the 'ray' backend runs 'cpu' or 'cuda'")
        self._actors: list[Any] = []
        self._placements: list[WorkerPlacement] = []
        self._monitor: DeathMonitor | None = None
        self._compiled: CompiledStep | None = None
        self._compiled_lock = threading.Lock()
        self._graph_submit_lock = threading.Lock()
        self._actor_submit_lock = threading.Lock()
        self._graph_read_lock = threading.Lock()
        self._use_compiled = options.compiled_graph and compiled_graphs_available()
        self._output_rank = config.output_rank
        # Ordered completion of non-blocking calls: one thread resolves them in turn.
        self._collector = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="executor-ray-collector"
        )
        self.add_cleanup(functools.partial(self._collector.shutdown, wait=False))
        self._gate = _PathGate()
        self._direct: DirectChannels | None = None
        self._direct_seq = 0
        self._direct_last: threading.Event | None = None  # set when the last call is read
        # Tokens for the steps the graph may have in flight (a C queue: cheap per step).
        self._max_inflight = max_inflight_steps() if self._use_compiled else 0
        self._compiled_slots: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(self._max_inflight):
            self._compiled_slots.put(None)

        lease = acquire_ray(options, world_size=config.world_size)
        self.add_cleanup(lease.release)
        group, _bundles = reserve_placement_group(options, config.device, config.world_size)
        self.add_cleanup(functools.partial(_remove_group, group))
        actors = self._create_actors(group, options)
        self.add_cleanup(functools.partial(_kill_actors, actors))
        deadline = time.monotonic() + options.startup_timeout
        infos: list[ActorInfo] = self._gather_startup(
            [actor.node_info.remote() for actor in actors], "start", deadline, raw=True
        )
        driver_node = ray.get_runtime_context().get_node_id()
        self._placements = assign_ranks(infos, driver_node)
        self._actors = [actors[p.actor_index] for p in self._placements]
        monitor = DeathMonitor(
            [actor.watch.remote() for actor in self._actors], _death_reporter(self)
        )
        self._monitor = monitor
        self.add_cleanup(monitor.stop)
        init_method = self._init_method(deadline)
        contexts = [self._context(p, init_method) for p in self._placements]
        init_refs = [
            actor.init_worker.remote(
                config.worker_cls, config.worker_kwargs, ctx, self._worker_env(placement)
            )
            for actor, ctx, placement in zip(self._actors, contexts, self._placements, strict=True)
        ]
        self._gather_startup(init_refs, "init_worker", deadline)
        one_node = all(p.node_id == driver_node for p in self._placements)
        if options.direct_calls and (one_node or options.direct_calls_across_nodes):
            self._open_direct_channels(deadline, driver_node)

    def _open_direct_channels(self, deadline: float, driver_node: str) -> None:
        authkey = os.urandom(32)
        # A Unix socket on the driver's node; TCP at the node's IP elsewhere.
        hosts = [None if p.node_id == driver_node else p.node_ip for p in self._placements]
        opened = [
            actor.open_channel.remote(authkey, host)
            for actor, host in zip(self._actors, hosts, strict=True)
        ]
        addresses = self._gather_startup(opened, "open_channel", deadline, raw=True)
        try:
            timeout_s = min(_CONNECT_S, max(1.0, deadline - time.monotonic()))
            channels = DirectChannels(addresses, authkey, timeout_s)
        # OSError: unreachable (another network namespace, a firewall) or a stalled
        # handshake; EOFError: the worker dropped a handshake that took too long.
        except (OSError, EOFError) as exc:
            logger.warning(
                "direct calls unavailable, using Ray actor calls: %s: %s", type(exc).__name__, exc
            )
            return
        self._direct = channels
        self.add_cleanup(channels.close)

    def _create_actors(self, group: PlacementGroup, options: RayOptions) -> list[Any]:
        bundle = bundle_for(options, self.config.device)
        custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        actor_options: dict[str, Any] = {
            "num_cpus": options.num_cpus_per_worker,
            "num_gpus": bundle.get("GPU", 0),
            "max_restarts": 0,
            "max_task_retries": 0,
        }
        if custom:
            actor_options["resources"] = custom
        if self.config.env:
            actor_options["runtime_env"] = {"env_vars": dict(self.config.env)}
        return [
            RayWorkerActor.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group,
                    placement_group_bundle_index=index,
                    placement_group_capture_child_tasks=True,
                ),
                **actor_options,
            ).remote()
            for index in range(self.config.world_size)
        ]

    def _init_method(self, deadline: float) -> str:
        """``tcp://`` on rank 0's node: the configured host when every rank shares one node
        (loopback by default), rank 0's node IP when they span several."""
        nodes = {p.node_id for p in self._placements}
        host = self.config.distributed_host if len(nodes) == 1 else self._placements[0].node_ip
        [port] = self._gather_startup(
            [self._actors[0].free_port.remote(host)], "free_port", deadline, raw=True
        )
        return tcp_init_method(host, port)

    def _context(self, placement: WorkerPlacement, init_method: str) -> WorkerContext:
        config = self.config
        return WorkerContext(
            rank=placement.rank,
            local_rank=placement.local_rank,
            world_size=config.world_size,
            tensor_parallel_size=config.tensor_parallel_size,
            pipeline_parallel_size=config.pipeline_parallel_size,
            distributed_init_method=init_method,
            device=config.device,
            local_world_size=placement.local_world_size,
            node_id=placement.node_id,
            backend="ray",
        )

    def _worker_env(self, placement: WorkerPlacement) -> dict[str, str]:
        env = dict(self.config.env)
        if self.config.device == "cuda" and placement.visible_devices is not None:
            # Ray shows each actor only its own GPU; showing the node's workers' GPUs in
            # local-rank order makes cuda:{local_rank} right, as on every other backend.
            env.setdefault("CUDA_VISIBLE_DEVICES", placement.visible_devices)
        return env

    def _gather_startup(
        self, refs: list[Any], what: str, deadline: float, *, raw: bool = False
    ) -> list[Any]:
        try:
            return self._gather(refs, what, deadline, self._options.startup_timeout, raw=raw)
        except RPCTimeoutError as exc:
            raise ExecutorError(
                f"Ray workers {list(exc.ranks)} did not finish {what!r} within "
                f"startup_timeout={self._options.startup_timeout:g} s; raise "
                "backend_options['startup_timeout'] if loading the model takes longer"
            ) from exc

    # --- public extras ---------------------------------------------------------------------

    @property
    def placements(self) -> list[WorkerPlacement]:
        """Each rank's node id, node IP, local rank and actor pid, in rank order."""
        return list(self._placements)

    @property
    def options(self) -> RayOptions:
        """The validated ``backend_options``."""
        return self._options

    @property
    def uses_direct_calls(self) -> bool:
        """True if small calls go on the executor's own sockets (see ``_direct``)."""
        return self._direct is not None

    @property
    def uses_compiled_graph(self) -> bool:
        """True if ``execute_model`` goes through a Ray Compiled Graph."""
        return self._use_compiled

    # --- calls -----------------------------------------------------------------------------

    def collective_rpc(  # type: ignore[override]  # one implementation for both overloads
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> list[Any] | Future[list[Any]]:
        self.check_open()
        self.check_reply_rank(unique_reply_rank)
        timeout = self.resolve_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        name = method_name(method)
        wire = dumps_method(method)
        call, lifted = self._encode_call(wire, args, kwargs, unique_reply_rank)
        direct = self._direct
        if direct is not None and type(call) is bytes and not lifted:
            wait = self._direct_call(direct, call, name, deadline, timeout)
        else:
            wait = self._actor_call(call, lifted, name, deadline, timeout)

        def replies() -> list[Any]:
            results = wait()
            if unique_reply_rank is not None:
                return [results[unique_reply_rank]]
            return results

        if non_block:
            return self._collector.submit(replies)  # one thread: futures complete in order
        return replies()

    def _actor_call(
        self,
        call: Any,
        lifted: list[Any],
        name: str,
        deadline: float | None,
        timeout: float | None,
    ) -> Callable[[], list[Any]]:
        """Submit ``call`` as one Ray actor task per rank; the function that gathers it."""
        self._enter("actor", name, deadline, timeout)
        try:
            # One lock around the submissions: calls from several threads then reach every
            # actor in the same order, so collectives inside worker methods cannot cross.
            with self._actor_submit_lock:
                refs = [actor.execute.remote(call, *lifted) for actor in self._actors]
        except BaseException:
            self._gate.leave()
            raise

        def wait() -> list[Any]:
            try:
                return self._gather(refs, name, deadline, timeout)
            finally:
                self._gate.leave()

        return wait

    def _direct_call(
        self,
        channels: DirectChannels,
        call: bytes,
        name: str,
        deadline: float | None,
        timeout: float | None,
    ) -> Callable[[], list[Any]]:
        """Send ``call`` on every rank's socket; the function that reads the replies.

        Replies are read in the order the calls were sent: a call's reader first waits for
        the previous call's reader to finish (so two never read one socket at once).
        """
        self._enter("direct", name, deadline, timeout)
        try:
            with self._actor_submit_lock:
                self._direct_seq += 1
                seq = self._direct_seq
                previous, done = self._direct_last, threading.Event()
                self._direct_last = done
                try:
                    channels.send(seq, call)
                except ChannelClosedError as exc:
                    done.set()
                    raise self._await_monitor(exc.rank, exc) from None
        except BaseException:
            self._gate.leave()
            raise

        def wait() -> list[Any]:
            try:
                return self._gather_direct(channels, seq, previous, name, deadline, timeout)
            finally:
                done.set()
                self._gate.leave()

        return wait

    def _gather_direct(
        self,
        channels: DirectChannels,
        seq: int,
        previous: threading.Event | None,
        name: str,
        deadline: float | None,
        timeout: float | None,
    ) -> list[Any]:
        while previous is not None and not previous.is_set():
            remaining = _remaining(deadline)
            if remaining is not None and remaining <= 0:
                raise RPCTimeoutError(name, range(self.world_size), timeout or 0.0)
            wait_s = _WAIT_SLICE_S if remaining is None else min(_WAIT_SLICE_S, remaining)
            if not previous.wait(wait_s):
                self._raise_if_stopped()
        results = []
        for rank in range(self.world_size):
            try:
                ok, result = channels.read(
                    rank, seq, deadline, _WAIT_SLICE_S, self._raise_if_stopped
                )
            except ChannelClosedError as exc:
                raise self._await_monitor(exc.rank, exc) from None
            if not ok:
                late = range(rank + 1, self.world_size)
                missing = [rank, *(r for r in late if not channels.answered(r))]
                raise RPCTimeoutError(name, missing, timeout or 0.0)
            results.append(result)
        return _raise_failures(results)

    def _encode_call(
        self,
        wire: str | bytes,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        reply_rank: int | None,
    ) -> tuple[Any, list[Any]]:
        """The call for :meth:`RayWorker.execute` and the arguments lifted out of it.

        Positional arguments of ``_LIFT_BYTES`` or more (bytes, arrays, tensors) become
        arguments of the Ray call itself, which Ray stores as it would for a plain actor
        call (bytes without a copy into a message); with several workers each is put into
        the object store once for all of them. The rest is pickled to bytes when it can be
        (see ``_encoding``), else left to Ray's serializer, and put once too when large.
        """
        positions = [i for i, value in enumerate(args) if _nbytes(value) >= _LIFT_BYTES]
        rest: list[Any] = list(args)
        lifted: list[Any] = []
        for i in positions:
            lifted.append(rest[i])
            rest[i] = None
        if self.world_size > 1:
            lifted = [ray.put(value) for value in lifted]  # Ray resolves top-level refs
        call: Any = [wire, rest, kwargs, reply_rank, positions]  # lists: see _actor.Call
        kwargs_nbytes = sum(_nbytes(v) for v in (kwargs or {}).values())
        if kwargs_nbytes < _LIFT_BYTES:
            return pack(call) or call, lifted
        if self.world_size > 1:
            call = ray.put(call)
        return call, lifted

    def execute_model(self, batch: Any, non_block: bool = False) -> Any:
        """Run one step; through the compiled graph when enabled (see :class:`CompiledStep`)."""
        if not self._use_compiled:
            return super().execute_model(batch, non_block)
        self.check_open()
        timeout = self.resolve_timeout(None)
        deadline = None if timeout is None else time.monotonic() + timeout
        self._enter("compiled", "execute_model", deadline, timeout)
        try:
            step = self._compiled
            if step is None or not step.compiled:
                # The first step (and the first after a release) compiles the graph, outside
                # the call's timeout.
                started = time.monotonic()
                step = self._compile()
                if deadline is not None:
                    deadline += time.monotonic() - started
            self._compiled_slots.get(timeout=_remaining(deadline))
        except queue.Empty:
            self._gate.leave()
            raise RPCTimeoutError("execute_model", range(self.world_size), timeout or 0.0) from None
        except BaseException:
            self._gate.leave()
            raise
        try:
            with self._graph_submit_lock:
                refs = step.submit(batch)
        except BaseException:
            self._compiled_slots.put(None)
            self._gate.leave()
            raise

        def wait() -> Any:
            try:
                # Ray's compiled graph is not thread-safe; one reader at a time (results of
                # earlier steps read along the way are buffered by Ray for their own reader).
                with self._graph_read_lock:
                    return self._gather_compiled(refs, deadline, timeout)
            finally:
                self._compiled_slots.put(None)
                self._gate.leave()

        if non_block:
            return self._collector.submit(wait)
        return wait()

    @property
    def compiled_graph_live(self) -> bool:
        """True while ``execute_model``'s compiled graph is compiled: its loops then poll on
        every worker (see :meth:`release_compiled_graph`)."""
        step = self._compiled
        return step is not None and step.compiled

    def release_compiled_graph(self, timeout: float | None = None) -> bool:
        """Tear down ``execute_model``'s compiled graph until the next step compiles it again.

        While a compiled graph is live, Ray's loop on each worker polls its input channel
        (spinning, though it yields the CPU), so an idle engine keeps a core per worker busy.
        Call this before a long idle spell; :meth:`sleep` calls it too. The next
        ``execute_model`` compiles the graph again (a fraction of a second). Waits for the
        steps in flight (up to ``timeout``; the executor's ``rpc_timeout`` when ``None``).
        Returns True if a graph was torn down, False if none was live.
        """
        self.check_open()
        timeout = self.resolve_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        self._enter("release", "release_compiled_graph", deadline, timeout)
        try:
            with self._compiled_lock:
                step = self._compiled
                return step is not None and step.release()
        finally:
            self._gate.leave()

    def sleep(self, level: int = 1) -> None:
        """As :meth:`Executor.sleep`; first releases the compiled graph (see
        :meth:`release_compiled_graph`), so that a sleeping engine's workers stay idle."""
        self.check_open()
        if self._use_compiled and not self.sleeping_tags:
            self.release_compiled_graph()
        super().sleep(level)

    def _compile(self) -> CompiledStep:
        """The compiled graph, compiled now if it is not live."""
        with self._compiled_lock:
            self.check_open()
            step = self._compiled
            if step is None:
                # Ray's graph code (and torch, if installed) is imported by each actor's loop:
                # seconds, once; done here, with the startup timeout.
                deadline = time.monotonic() + self._options.startup_timeout
                prepared = [actor.prepare_compiled.remote() for actor in self._actors]
                self._gather_startup(prepared, "prepare_compiled", deadline, raw=True)
                step = CompiledStep(
                    self._actors, self.config.tensor_parallel_size, self._max_inflight
                )
                self._compiled = step
                self.add_cleanup(functools.partial(_teardown_quietly, step))
            step.compile()
            return step

    def _enter(self, path: str, name: str, deadline: float | None, timeout: float | None) -> None:
        if not self._gate.enter(path, _remaining(deadline)):
            raise RPCTimeoutError(name, range(self.world_size), timeout or 0.0)

    # --- waiting ---------------------------------------------------------------------------

    def _gather(
        self,
        refs: Sequence[Any],
        name: str,
        deadline: float | None,
        timeout: float | None,
        *,
        raw: bool = False,
    ) -> list[Any]:
        """Wait for one reply per rank; raise on timeout, worker error, death or shutdown."""
        while True:
            remaining = _remaining(deadline)
            wait_s = _WAIT_SLICE_S if remaining is None else min(_WAIT_SLICE_S, remaining)
            try:
                replies: list[Any] = ray.get(list(refs), timeout=wait_s)
                break
            except GetTimeoutError:
                pass
            except RayError as exc:
                raise self._diagnose(refs, name, exc) from None
            self._raise_if_stopped()
            if remaining is not None and remaining <= wait_s:
                ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
                done = set(ready)
                missing = [rank for rank, ref in enumerate(refs) if ref not in done]
                raise RPCTimeoutError(name, missing, timeout or 0.0)
        if raw:
            return replies
        return _unpack(replies)

    def _diagnose(self, refs: Sequence[Any], name: str, exc: RayError) -> ExecutorError:
        """The error to raise for a Ray-level failure of one of ``refs`` (by rank)."""
        for rank, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=0)
            except GetTimeoutError:
                continue
            except RayActorError as err:
                return self._report_death(rank, err)
            except RayTaskError as err:
                return WorkerError(rank, name, type(err.cause).__name__, str(err.cause), str(err))
            except RayError as err:
                return WorkerError(rank, name, type(err).__name__, str(err), str(err))
        if isinstance(exc, RayActorError):
            return self._report_death(-1, exc)
        return ExecutorError(f"Ray failed during {name!r}: {exc}")

    def _monitors_verdict(self) -> ExecutorError | None:
        """After a transport noticed a worker gone: the error to raise if the executor was
        shut down or the monitor reports the death within a moment (its error names the rank,
        node and Ray's reason; it notices about when the transport does), else None."""
        give_up = time.monotonic() + 2.0
        while not self._closed and self._failure is None and time.monotonic() < give_up:
            time.sleep(0.05)
        if self._closed:
            return ExecutorClosedError("the executor was shut down during the call")
        return self._failure

    def _await_monitor(self, rank: int, exc: ChannelClosedError) -> ExecutorError:
        """A worker's direct channel closed: report its death."""
        return self._monitors_verdict() or self._report_death(rank, exc)

    def _gather_compiled(
        self, refs: list[Any], deadline: float | None, timeout: float | None
    ) -> Any:
        replies: list[Any] = []
        try:
            for ref in refs:
                remaining = _remaining(deadline, default=-1)
                replies.append(ref.get(timeout=remaining))
        except RayChannelTimeoutError:
            raise RPCTimeoutError(
                "execute_model", self._busy_ranks() or range(self.world_size), timeout or 0.0
            ) from None
        except RayError as exc:
            raise self._compiled_failure(exc) from None
        # Replies cross as they are (see RayWorker.execute_model_compiled).
        return _raise_failures(replies)[self._output_rank]

    def _compiled_failure(self, exc: BaseException) -> ExecutorError:
        """A compiled-graph read failed: report the dead worker if the monitor names one."""
        verdict = self._monitors_verdict()
        if verdict is not None:
            return verdict
        error = ExecutorFailedError(f"the compiled graph of execute_model failed: {exc}")
        self.fail(error)
        return self._failure or error

    def _busy_ranks(self) -> list[int]:
        try:
            running = ray.get([a.running.remote() for a in self._actors], timeout=2.0)
        except RayError:
            return []
        return [rank for rank, what in enumerate(running) if what is not None]

    def _raise_if_stopped(self) -> None:
        if self._closed:
            raise ExecutorClosedError("the executor was shut down during the call")
        failure = self._failure
        if failure is not None:
            raise failure

    # --- failure ---------------------------------------------------------------------------

    def _report_death(self, rank: int, error: BaseException) -> ExecutorFailedError:
        """Fail the executor because ``rank``'s actor (or its node) is gone; return the error."""
        died = WorkerDiedError(rank, detail=self._death_detail(rank, error))
        if self.fail(died):
            logger.error("%s", died)
            step = self._compiled
            if step is not None:
                # Wake waiters blocked on the graph's channels.
                threading.Thread(target=_teardown_quietly, args=(step,), daemon=True).start()
        return self._failure or died

    def _death_detail(self, rank: int, error: BaseException) -> str:
        where = ""
        if 0 <= rank < len(self._placements):
            placement = self._placements[rank]
            where = (
                f"Ray actor pid {placement.pid} on node {placement.node_id} ({placement.node_ip}); "
            )
        reason = " ".join(
            line.strip()
            for line in str(error).splitlines()
            if line.strip().startswith(("The actor", "the actor"))
        )
        return where + (reason or f"{type(error).__name__}: {str(error).splitlines()[0]}")

    # --- shutdown --------------------------------------------------------------------------

    def _shutdown_workers(self) -> None:
        """Graceful part: tear the graph down and let each worker run its shutdown.

        The forceful part (stop the monitor, kill the actors, remove the placement group,
        release Ray) is in the cleanups, so that the finalizer runs it too.
        """
        monitor = getattr(self, "_monitor", None)
        if monitor is not None:
            monitor.stop()
        direct = getattr(self, "_direct", None)
        if direct is not None:
            direct.close()  # wakes a thread waiting for a reply; the workers' threads exit
        step = getattr(self, "_compiled", None)
        if step is not None:
            _teardown_quietly(step)
        actors = getattr(self, "_actors", [])
        if actors and self._failure is None and ray.is_initialized():
            try:
                refs = [actor.shutdown.remote() for actor in actors]
                ray.wait(refs, num_returns=len(refs), timeout=_GRACEFUL_S)
            except RayError:
                logger.debug("graceful shutdown of the Ray workers failed", exc_info=True)


def _death_reporter(executor: RayExecutor) -> Callable[[int, BaseException], None]:
    """The monitor's callback; holds the executor weakly so that it can be collected."""
    ref = weakref.ref(executor)

    def report(rank: int, error: BaseException) -> None:
        target = ref()
        if target is not None:
            target._report_death(rank, error)

    return report


def _unpack(replies: list[Any]) -> list[Any]:
    """The results in the replies, or the first rank's failure raised as its error."""
    return _raise_failures([decode_reply(reply) for reply in replies])


def _raise_failures(results: list[Any]) -> list[Any]:
    for result in results:
        if isinstance(result, Failed):
            raise result.failure.to_error()
    return results


class _PathGate:
    """Calls go by one of three paths: the direct sockets, Ray actor tasks, the compiled
    graph. Calls on one path may overlap (each path keeps its own order); a call on another
    path waits until none is in flight, so that every worker sees all calls in one order and
    collectives inside worker methods cannot cross."""

    def __init__(self) -> None:
        # The plain lock guards the counts; the condition on it is used only to wait (the
        # common case, a call on the path already in use, costs one C-level lock round).
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._path = ""
        self._inflight = 0
        self._waiting = 0

    def enter(self, path: str, timeout: float | None) -> bool:
        """Wait (up to ``timeout``) until ``path`` may be used; False on timeout."""
        with self._lock:
            if self._inflight and self._path != path:
                self._waiting += 1
                try:
                    if not self._cond.wait_for(
                        lambda: self._inflight == 0 or self._path == path, timeout=timeout
                    ):
                        return False
                finally:
                    self._waiting -= 1
            self._path = path
            self._inflight += 1
            return True

    def leave(self) -> None:
        """A call entered with :meth:`enter` completed (or failed)."""
        with self._lock:
            self._inflight -= 1
            if self._inflight == 0 and self._waiting:
                self._cond.notify_all()


def _remaining(deadline: float | None, default: float | None = None) -> float | None:
    if deadline is None:
        return default
    return max(0.0, deadline - time.monotonic())


def _nbytes(value: Any) -> int:
    """The size of a buffer (bytes, str, array, tensor, memoryview); 0 for anything else."""
    if isinstance(value, bytes | bytearray | str):
        return len(value)
    nbytes = getattr(value, "nbytes", None)  # numpy arrays, torch tensors, memoryviews
    return nbytes if isinstance(nbytes, int) else 0


def _teardown_quietly(step: CompiledStep) -> None:
    try:
        step.teardown(quiet=True)
    except Exception:  # teardown after a death may fail; the actors die anyway
        logger.debug("compiled graph teardown failed", exc_info=True)


def _kill_actors(actors: Sequence[Any]) -> None:
    if not ray.is_initialized():
        return
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already dead or Ray gone: nothing left to kill
            logger.debug("ray.kill failed", exc_info=True)


def _remove_group(group: PlacementGroup) -> None:
    if not ray.is_initialized():
        return
    try:
        remove_placement_group(group)
    except Exception:  # already removed or Ray gone
        logger.debug("remove_placement_group failed", exc_info=True)
