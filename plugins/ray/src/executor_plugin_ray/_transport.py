"""RayTransport: one Ray actor per rank, and the three paths a call takes to them.

The core owns every rule of a call (order, timeouts, reply gathering, failure, shutdown);
this transport starts the actors, carries each call on one of three paths, and hands every
rank's reply to ``host.deliver``:

* **direct** (``_direct``): a small call goes on the executor's own socket to each worker,
  when every worker is on the driver's node (or with ``direct_calls_across_nodes``);
* **actor calls**: one Ray actor task per rank, for workers elsewhere and for calls that Ray
  carries better (large buffers, Ray object refs; see ``_encoding``);
* **compiled graph** (``_compiled``): ``execute_model`` with ``compiled_graph`` enabled.

Replies are read by the core's waiting threads (``polls = True``): :meth:`RayTransport.poll`
reads the replies of the calls in flight, oldest first. A call on another path than the
calls in flight waits until they are all answered (``_gate``), so that every worker runs
all calls in one order. A monitor (``_monitor``) reports a dead actor or node with
``host.worker_died``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import (
    GetTimeoutError,
    RayActorError,
    RayChannelTimeoutError,
    RayError,
    RayTaskError,
)

from executor_core import (
    ExecutorClosedError,
    ExecutorFailedError,
    WorkerDiedError,
    WorkerError,
)
from executor_core.backend import Call, Transport, TransportHost, tcp_init_method

from ._cluster import acquire_ray
from ._compiled import (
    CompiledStep,
    compiled_graphs_available,
    max_inflight_steps,
    read_outputs,
    teardown_quietly,
)
from ._direct import ChannelClosedError, DirectChannels
from ._encoding import Failed, decode_reply, encode_call
from ._gate import ACTOR, COMPILED, DIRECT, PathGate, Pending
from ._launch import (
    Startup,
    create_actors,
    hold_lifelines,
    kill_actors,
    open_direct_channels,
    raise_failures,
    remove_group,
)
from ._lifeline import DriverLifelines
from ._monitor import DeathMonitor, death_detail
from ._options import RayOptions
from ._placement import reserve_placement_group
from ._ranks import WorkerPlacement, assign_ranks

__all__ = ["RayTransport"]

logger = logging.getLogger("executor_plugin_ray")

#: Seconds the graceful part of close may take before the actors are killed.
_GRACEFUL_S = 5.0
#: After a transport noticed a worker gone: how long to wait for the monitor's report, which
#: names the rank, node and Ray's reason (it notices about when the transport does).
_MONITOR_GRACE_S = 2.0
#: Longest wait of a poll with nothing to read, and the default slice of one with no timeout.
_IDLE_S = 0.01
_SLICE_S = 1.0
#: Longest single wait of a sender waiting for its path (or a graph slot): it reads replies
#: meanwhile when no other thread does (``host.while_blocked``), else waits for the reader.
_ROOM_MAX_S = 0.02


def _succeeded(reply: tuple[int, int, Any]) -> bool:
    return type(reply[2]) is not Failed


class RayTransport(Transport):
    """Starts one Ray actor per rank in a placement group and carries calls to them."""

    polls = True

    def __init__(self, host: TransportHost) -> None:
        super().__init__(host)
        config = host.config
        #: The validated ``backend_options`` (validated here, before Ray starts).
        self.options = RayOptions.from_backend_options(config.backend_options)
        self._world_size = config.world_size
        self._output_rank = config.output_rank
        #: The actors, in rank order, and where each runs.
        self.actors: list[Any] = []
        self.placements: list[WorkerPlacement] = []
        self._monitor: DeathMonitor | None = None
        self._direct: DirectChannels | None = None
        self._gate = PathGate()
        self._interrupted = threading.Event()
        self._closing = False
        self._stopped = False  # interrupted or closing: one flag for the hot path
        self._wake_r = self._wake_w = -1  # a pipe that wakes a poll waiting on the sockets
        self._use_compiled = self.options.compiled_graph and compiled_graphs_available()
        self._max_inflight = max_inflight_steps() if self._use_compiled else 0
        self._compiled: CompiledStep | None = None
        self._compiled_lock = threading.Lock()

    # --- start -----------------------------------------------------------------------------

    def start(self) -> None:
        host, options, config = self.host, self.options, self.host.config
        self._wake_r, self._wake_w = os.pipe()
        host.add_cleanup(self._close_pipe)
        lease = acquire_ray(options, world_size=config.world_size)
        host.add_cleanup(lease.release)
        group, _bundles = reserve_placement_group(options, config.device, config.world_size)
        host.add_cleanup(functools.partial(remove_group, group))
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
        hold_lifelines(lifelines, self.actors, placements, driver_node, startup, deadline)
        init_method = self._init_method(startup, deadline)
        wrappers = []
        for placement in placements:
            context = host.context(
                placement.rank,
                local_rank=placement.local_rank,
                local_world_size=placement.local_world_size,
                node_id=placement.node_id,
                init_method=init_method,
            )
            wrapper = host.wrapper(context)
            if config.device == "cuda" and placement.visible_devices is not None:
                # Ray shows each actor only its own GPU; showing the node's workers' GPUs in
                # local-rank order makes cuda:{local_rank} right, as on every other backend.
                wrapper.env.setdefault("CUDA_VISIBLE_DEVICES", placement.visible_devices)
            wrappers.append(wrapper)
        inits = [
            actor.init_worker.remote(wrapper)
            for actor, wrapper in zip(self.actors, wrappers, strict=True)
        ]
        raise_failures(startup.gather(inits, "init_worker", deadline))
        one_node = all(p.node_id == driver_node for p in placements)
        if options.direct_calls and (one_node or options.direct_calls_across_nodes):
            direct = open_direct_channels(self.actors, placements, driver_node, startup, deadline)
            if direct is not None:
                self._direct = direct
                host.add_cleanup(direct.close)

    def _init_method(self, startup: Startup, deadline: float) -> str:
        """``tcp://`` on rank 0's node: the configured host when every rank shares one node
        (loopback by default), rank 0's node IP when they span several."""
        placements = self.placements
        nodes = {p.node_id for p in placements}
        address = self.host.config.distributed_host if len(nodes) == 1 else placements[0].node_ip
        [port] = startup.gather([self.actors[0].free_port.remote(address)], "free_port", deadline)
        return tcp_init_method(address, port)

    def _check_running(self) -> None:
        """Raise if the executor failed or is closing (ends a wait at start)."""
        if self._stopped:
            raise self.host.failure or ExecutorClosedError("the executor was shut down")

    # --- extras (see RayExecutor) ------------------------------------------------------------

    @property
    def uses_direct_calls(self) -> bool:
        return self._direct is not None

    @property
    def uses_compiled_graph(self) -> bool:
        return self._use_compiled

    @property
    def compiled_graph_live(self) -> bool:
        step = self._compiled
        return step is not None and step.compiled

    def wait_compiled_drained(self, deadline: float | None) -> bool:
        """Wait until no compiled-graph step is in flight (False at ``deadline``, or if the
        executor failed or closed). Call it holding the executor's send lock."""
        gate = self._gate
        return self._wait_room(lambda: gate.drained(COMPILED), deadline)

    def release_compiled_graph(self) -> bool:
        """Tear the compiled graph down (see :meth:`wait_compiled_drained`); True if one was
        live. The next compiled step compiles it again."""
        with self._compiled_lock:
            step = self._compiled
            return step is not None and step.release()

    # --- send ------------------------------------------------------------------------------

    def send(self, call: Call) -> bool:
        if (
            self._use_compiled
            and call.method == "execute_model"
            and call.reply_rank == self._output_rank
            and len(call.args) == 1
            and not call.kwargs
        ):
            return self._send_compiled(call)
        encoded, lifted = encode_call(
            call.wire_method, call.args, call.kwargs, call.reply_rank, self._world_size
        )
        direct = self._direct
        gate = self._gate
        if direct is not None and type(encoded) is bytes and not lifted:
            if not gate.admits(DIRECT) and not self._wait_room(
                lambda: gate.admits(DIRECT), call.deadline
            ):
                return False
            entry = Pending(call.seq, DIRECT, call.name, self._world_size)
            gate.add(entry)  # first: the reply may be read before send() returns
            try:
                direct.send(call.seq, encoded)
            except ChannelClosedError as exc:
                gate.remove(entry)
                self._channel_closed(exc)
                raise self.host.failure or ExecutorClosedError(
                    "the executor was shut down during the call"
                ) from None
            return True
        if not gate.admits(ACTOR) and not self._wait_room(
            lambda: gate.admits(ACTOR), call.deadline
        ):
            return False
        refs = [actor.execute.remote(encoded, *lifted) for actor in self.actors]
        gate.add(Pending(call.seq, ACTOR, call.name, len(refs), refs=refs))
        return True

    def _send_compiled(self, call: Call) -> bool:
        gate, limit = self._gate, self._max_inflight
        # Up to Ray's own limit of steps in flight: a further one waits for the oldest.
        if not gate.admits(COMPILED, limit) and not self._wait_room(
            lambda: gate.admits(COMPILED, limit), call.deadline
        ):
            return False
        step = self._compiled
        if step is None or not step.compiled:
            # The first step (and the first after a release) compiles the graph, outside the
            # call's timeout.
            started = time.monotonic()
            step = self._compile()
            if call.deadline is not None:
                call.deadline += time.monotonic() - started
        refs = step.submit(call.args[0])
        gate.add(Pending(call.seq, COMPILED, call.name, len(refs), call.deadline, refs))
        return True

    def _compile(self) -> CompiledStep:
        """The compiled graph, compiled now if it is not live."""
        with self._compiled_lock:
            self._check_running()
            step = self._compiled
            if step is None:
                # Ray's graph code (and torch, if installed) is imported by each actor's loop:
                # seconds, once; done here, within the startup timeout.
                startup = Startup(self.options, self._check_running)
                startup.placements = self.placements
                prepared = [actor.prepare_compiled.remote() for actor in self.actors]
                startup.gather(prepared, "prepare_compiled", startup.deadline())
                step = CompiledStep(
                    self.actors, self.host.config.tensor_parallel_size, self._max_inflight
                )
                self._compiled = step
                self.host.add_cleanup(functools.partial(teardown_quietly, step))
            step.compile()
            return step

    def _wait_room(self, ready: Callable[[], bool], deadline: float | None) -> bool:
        """Wait until ``ready()`` (calls in flight were answered); False at ``deadline`` or
        once the executor failed or is closing. Reads replies meanwhile when no other thread
        does, since the calls waited for may have no other reader."""
        gate, host = self._gate, self.host
        while not self._stopped:
            if ready():
                return True
            wait_s = _ROOM_MAX_S
            if deadline is not None:
                wait_s = min(wait_s, deadline - time.monotonic())
                if wait_s <= 0:
                    return ready()
            # Read replies here for up to wait_s if nobody else does; else wait for the reader.
            if not host.while_blocked(wait_s) and gate.wait(ready, wait_s):
                return True
        return False

    # --- replies ---------------------------------------------------------------------------

    def poll(self, timeout: float | None) -> None:
        if self._stopped:
            self._interrupted.wait(_IDLE_S)
            return
        entry = self._gate.oldest()
        if entry is None:  # nothing in flight (a moment between two calls)
            self._interrupted.wait(_IDLE_S if timeout is None else min(timeout, _IDLE_S))
            return
        if timeout is None:
            timeout = _SLICE_S
        path = entry.path
        if path == DIRECT:
            self._poll_direct(timeout)
        elif path == ACTOR:
            self._poll_actor(entry, timeout)
        else:
            self._poll_compiled(entry)

    def _deliver(self, seq: int, rank: int, reply: Any) -> None:
        if type(reply) is Failed:
            self.host.deliver(seq, rank, False, reply.failure)
        else:
            self.host.deliver(seq, rank, True, reply)

    def _deliver_all(self, replies: list[tuple[int, int, Any]]) -> None:
        """Deliver ``(seq, rank, reply)`` read together, failures first: a rank that need not
        answer (``unique_reply_rank``) reports its failure only if it arrives before the
        replying rank's result completes the call."""
        if len(replies) > 1:
            replies.sort(key=_succeeded)
        for seq, rank, reply in replies:
            self._deliver(seq, rank, reply)

    def _read(self, entry: Pending, rank: int) -> None:
        """``rank``'s reply to ``entry`` was read; ``entry`` leaves once all were."""
        if entry.refs is not None:
            entry.refs[rank] = None
        entry.left -= 1
        if not entry.left:
            self._gate.remove(entry)

    def _poll_direct(self, timeout: float) -> None:
        """Read the replies on the direct sockets (each carries its call's number)."""
        direct = self._direct
        assert direct is not None
        replies = []
        for rank in direct.wait(timeout, self._wake_r):
            try:
                seq, reply = direct.recv(rank)
            except ChannelClosedError as exc:
                self._channel_closed(exc)
                return
            replies.append((seq, rank, reply))
        self._deliver_all(replies)
        gate = self._gate
        for seq, rank, _reply in replies:
            entry = gate.get(seq)
            if entry is not None:
                self._read(entry, rank)

    def _poll_actor(self, entry: Pending, timeout: float) -> None:
        """Read the oldest actor call's replies (Ray object refs, one per rank)."""
        refs = entry.refs
        assert refs is not None
        pending = [(rank, ref) for rank, ref in enumerate(refs) if ref is not None]
        try:
            replies = ray.get([ref for _rank, ref in pending], timeout=timeout)
        except GetTimeoutError:
            # Deliver what is there, so that a timeout names only the ranks that are late.
            ready, _ = ray.wait(
                [ref for _rank, ref in pending], num_returns=len(pending), timeout=0
            )
            done = set(ready)
            for rank, ref in pending:
                if ref in done:
                    self._read_ref(entry, rank, ref)
            return
        except RayError:
            for rank, ref in pending:
                self._read_ref(entry, rank, ref)
            return
        seq = entry.seq
        self._deliver_all(
            [
                (seq, rank, decode_reply(reply))
                for (rank, _ref), reply in zip(pending, replies, strict=True)
            ]
        )
        for rank, _ref in pending:
            self._read(entry, rank)

    def _read_ref(self, entry: Pending, rank: int, ref: Any) -> None:
        """Read one rank's reply to an actor call, if it is there (a Ray-level failure too)."""
        seq = entry.seq
        try:
            reply = ray.get(ref, timeout=0)
        except GetTimeoutError:
            return
        except RayActorError as err:
            self._read(entry, rank)
            self._report_death(rank, err)
            return
        except RayTaskError as err:
            cause = err.cause
            error = WorkerError(rank, entry.name, type(cause).__name__, str(cause), str(err))
            self.host.deliver(seq, rank, False, error)
        except RayError as err:
            error = WorkerError(rank, entry.name, type(err).__name__, str(err), str(err))
            self.host.deliver(seq, rank, False, error)
        else:
            self._deliver(seq, rank, decode_reply(reply))
        self._read(entry, rank)

    def _poll_compiled(self, entry: Pending) -> None:
        """Read the oldest compiled step's outputs (every rank's at once).

        Unlike the other paths this read is not cut into the poll's slices (see
        :func:`~._compiled.read_outputs`): a step is read until it completes or its call's
        deadline passes; then its late output is dropped, as Ray does for a step whose refs
        are dropped. A teardown (close, or the executor failing) wakes the read.
        """
        refs = entry.refs
        assert refs is not None
        try:
            outputs = read_outputs(refs, entry.deadline)
        except RayChannelTimeoutError:
            entry.refs = None  # drops the step's refs: Ray discards their output
            self._gate.remove(entry)
            return
        except Exception as exc:  # noqa: BLE001 - any failure of the graph's read is reported
            entry.refs = None
            self._gate.remove(entry)
            self._compiled_failed(exc)
            return
        entry.refs = None
        seq, deliver = entry.seq, self.host.deliver
        for rank, output in enumerate(outputs):  # failures first (see _deliver_all)
            if type(output) is Failed:
                deliver(seq, rank, False, output.failure)
        for rank, output in enumerate(outputs):
            if type(output) is not Failed:
                deliver(seq, rank, True, output)
        self._gate.remove(entry)  # after the replies: a sender waiting for it sees them

    # --- failures --------------------------------------------------------------------------

    def _report_death(self, rank: int, error: BaseException) -> None:
        """``rank``'s actor (or its node) is gone: fail the executor with the rank, where it
        ran and Ray's reason. Called by the monitor and by the paths."""
        placements = self.placements
        placement = placements[rank] if 0 <= rank < len(placements) else None
        died = WorkerDiedError(rank, detail=death_detail(placement, error))
        self.host.worker_died(died)
        if self.host.failure is died:
            logger.error("%s", died)

    def _channel_closed(self, exc: ChannelClosedError) -> None:
        """A worker's direct socket closed: its actor stopped or died."""
        if self._closing:
            return
        # The monitor names the rank, node and Ray's reason, and notices about when the socket
        # does: give it a moment, else report the death from here.
        if not self._interrupted.wait(_MONITOR_GRACE_S) and not self._closing:
            self._report_death(exc.rank, exc)

    def _compiled_failed(self, exc: BaseException) -> None:
        """A compiled-graph read failed: report the dead worker if the monitor names one."""
        if self._closing or self._interrupted.wait(_MONITOR_GRACE_S) or self._closing:
            return
        self.host.worker_died(
            ExecutorFailedError(f"the compiled graph of execute_model failed: {exc}")
        )

    def interrupt(self) -> None:
        self._stopped = True
        self._interrupted.set()
        self._wake()
        step = self._compiled
        if step is not None and step.compiled and not self._closing:
            # Wake a thread blocked on the graph's channels.
            threading.Thread(
                target=teardown_quietly, args=(step,), name="executor-ray-teardown", daemon=True
            ).start()

    def _wake(self) -> None:
        self._gate.wake()
        if self._wake_w >= 0:
            with contextlib.suppress(OSError):  # closed, or full: a wake-up is pending anyway
                os.write(self._wake_w, b"\0")

    # --- close -----------------------------------------------------------------------------

    def close(self, graceful: bool) -> None:
        """Tear the graph down and (graceful) let each worker run its shutdown. Killing the
        actors, removing the placement group and releasing Ray are cleanups, which the
        finalizer runs too."""
        self._closing = self._stopped = True
        self._wake()
        monitor = self._monitor
        if monitor is not None:
            monitor.stop()
        direct = self._direct
        if direct is not None:
            direct.shutdown()  # wakes a reader; the workers' threads exit
        step = self._compiled
        if step is not None:
            teardown_quietly(step)
        actors = self.actors
        if graceful and actors and ray.is_initialized():
            try:
                refs = [actor.shutdown.remote() for actor in actors]
                ray.wait(refs, num_returns=len(refs), timeout=_GRACEFUL_S)
            except RayError:
                logger.debug("graceful shutdown of the Ray workers failed", exc_info=True)

    def _close_pipe(self) -> None:
        fds = (self._wake_r, self._wake_w)
        self._wake_r = self._wake_w = -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)
