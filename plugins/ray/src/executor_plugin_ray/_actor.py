"""The Ray actor that hosts one rank's worker through the core's WorkerWrapper."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from executor_channel import Kind, SegmentLayout, WorkerFds, WorkerRings, encode, serve_rings
from executor_core import ExecutorConfig
from executor_core.backend import RemoteFailure, WorkerWrapper, preload_worker, reserve_port

from ._lifeline import ActorLifeline, Address, hold
from ._options import RayOptions
from ._placement import ActorInfo, bundle_for

__all__ = ["MONITOR_GROUP", "Failed", "RayWorker", "RayWorkerActor", "create_actor"]

#: The actor's second thread: the liveness watch, so that it answers while the worker is
#: busy in a long call.
MONITOR_GROUP = "executor_monitor"

#: Seconds a worker on the driver's node waits for its rings' descriptors (sent before
#: ``attach_rings`` is called: they are there already).
_ATTACH_S = 10.0


@attrs.frozen
class Failed:
    """A worker's failure as the reply of a start-up step."""

    failure: RemoteFailure


class RayWorker:
    """One rank. Ray calls its start-up steps and its shutdown; the executor's calls come
    through the channel on a thread of their own (the driver's rings on its node, the hub
    elsewhere), one at a time (a lock), each run by the core's
    :class:`~executor_core.backend.WorkerWrapper`."""

    def __init__(self) -> None:
        self._wrapper: WorkerWrapper | None = None
        self._rank = -1
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._lifeline: ActorLifeline | None = None
        self._rings: WorkerRings | None = None
        self._member: Any = None  # a MemberServer, for a worker on another node

    # --- set-up ----------------------------------------------------------------------------

    def node_info(self) -> ActorInfo:
        """Where this actor runs."""
        context = ray.get_runtime_context()
        gpu_ids = context.get_accelerator_ids().get("GPU", [])
        return ActorInfo(
            node_id=context.get_node_id(),
            node_ip=ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]  # unannotated in ray
            pid=os.getpid(),
            gpu_ids=tuple(str(gpu) for gpu in gpu_ids),
        )

    def warm_up(self, worker_cls: type | str) -> None:
        """A spare's wait (``_spare``): import what defines the worker class. A failing
        import is left to the start of the rank it is handed, which reports it."""
        with contextlib.suppress(Exception):
            preload_worker(worker_cls)

    def free_port(self, host: str) -> int:
        """A port on this node kept free for the torch.distributed rendezvous (rank 0's)."""
        return reserve_port(host)

    def init_worker(self, wrapper: WorkerWrapper) -> Failed | None:
        """Build the user's worker (``wrapper``, from ``TransportHost.wrapper``) and run
        init_device and load_model."""
        context = wrapper.context
        self._rank = context.rank
        self._wrapper = wrapper
        with self._lock:
            try:
                wrapper.init_worker()
            except Exception as exc:  # noqa: BLE001 - shipped to the driver with its traceback
                return Failed(RemoteFailure.capture(context.rank, "init_worker", exc))
        return None

    def hold_lifeline(self, address: Address, key: bytes, timeout_s: float) -> str | None:
        """Connect to the driver's lifeline (see ``_lifeline``): from now on this process
        exits as soon as the driver's process is gone. None, or why it could not."""
        try:
            self._lifeline = hold(address, key, timeout_s)
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def attach_rings(
        self, index: int, layout: SegmentLayout, spin_s: float, idle_spin_s: float
    ) -> Failed | None:
        """Attach to the driver's rings as worker ``index`` of its node (their descriptors
        come over this actor's lifeline), say ready on them and serve calls from them on a
        thread of their own. None, or why it could not."""
        try:
            if self._lifeline is None:
                raise RuntimeError("this actor holds no lifeline to take the rings from")
            fds = self._lifeline.take_fds(_ATTACH_S)
            names = attrs.fields_dict(WorkerFds)
            rings = WorkerRings.attach(
                WorkerFds(**dict(zip(names, fds, strict=True))), layout, index, spin_s, idle_spin_s
            )
        except Exception as exc:  # noqa: BLE001 - shipped to the driver with its traceback
            return Failed(RemoteFailure.capture(self._rank, "attach_rings", exc))
        self._rings = rings
        rings.replies.write(*encode(Kind.READY, True, self._rank, 0, os.getpid()))
        thread = threading.Thread(
            target=serve_rings,
            args=(self._handle, rings.calls, rings.replies, self._rank),
            name="executor-ray-calls",
            daemon=True,
        )
        thread.start()
        return None

    def join_hub(
        self,
        address: str,
        key: bytes,
        rank: int,
        version: str,
        node_timeout_s: float,
        join_timeout: float,
    ) -> Failed | None:
        """Join the driver's hub at ``address`` (on another node) as this rank's member,
        authenticated with ``key``, and serve its calls. None, or why it could not."""
        from executor_channel import MemberServer, Secret

        try:
            self._member = MemberServer(
                address,
                Secret(key),
                rank,
                self._handle,
                version=version,
                node_timeout_s=node_timeout_s,
                join_timeout=join_timeout,
            )
        except Exception as exc:  # noqa: BLE001 - shipped to the driver with its traceback
            return Failed(RemoteFailure.capture(self._rank, "join_hub", exc))
        return None

    # --- calls -----------------------------------------------------------------------------

    def _handle(
        self,
        method: str | bytes | Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any] | None,
        reply_rank: int | None,
    ) -> tuple[bool, Any] | None:
        """Run one call from the channel (one at a time, as the actor's own methods)."""
        wrapper = self._wrapper
        if wrapper is None:
            error = RuntimeError(f"the worker of rank {self._rank} is not initialised")
            return False, RemoteFailure.capture(self._rank, "<call>", error)
        with self._lock:
            return wrapper.handle(method, args, kwargs, reply_rank)

    # --- monitoring ------------------------------------------------------------------------

    @ray.method(concurrency_group=MONITOR_GROUP)
    def watch(self) -> None:
        """Returns when the worker shuts down; fails with ActorDiedError if the actor dies."""
        self._stopped.wait()

    @ray.method(concurrency_group=MONITOR_GROUP)
    def alive(self) -> bool:
        """The liveness probe (``Transport.probe``): answered on a thread of its own, so a
        worker busy in a call answers and a stopped or frozen process does not."""
        return True

    def shutdown(self) -> None:
        """Call the worker's shutdown and release the watch."""
        try:
            with self._lock:
                if self._wrapper is not None:
                    self._wrapper.shutdown()
        finally:
            self._stopped.set()


#: The actor class. ``max_concurrency=1`` for the default group keeps calls in order.
# ray.remote's overloads omit concurrency_groups, which it accepts.
RayWorkerActor = ray.remote(concurrency_groups={MONITOR_GROUP: 2})(RayWorker)  # type: ignore[call-overload]


def create_actor(
    group: PlacementGroup,
    index: int,
    options: RayOptions,
    config: ExecutorConfig,
    spare_env: dict[str, str] | None = None,
) -> Any:
    """An actor in bundle ``index`` of ``group``: at start, for a rank replacement (a bundle
    stays on its node, so the new actor lands where the dead one ran), or a spare
    (``spare_env``: asking Ray for nothing, see ``_spare``)."""
    bundle = bundle_for(options, config.device)
    resources = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    env = dict(config.env) if spare_env is None else spare_env
    spare = spare_env is not None
    return RayWorkerActor.options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group,
            placement_group_bundle_index=index,
            placement_group_capture_child_tasks=True,
        ),
        num_cpus=0 if spare else options.num_cpus_per_worker,
        num_gpus=0 if spare else bundle.get("GPU", 0),
        max_restarts=0,
        max_task_retries=0,
        **({"resources": resources} if resources and not spare else {}),
        **({"runtime_env": {"env_vars": env}} if env else {}),
    ).remote()
