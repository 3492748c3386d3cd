"""The Ray actor that hosts one rank's worker through the core's WorkerWrapper."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from executor_core.backend import RemoteFailure, WorkerWrapper, find_free_port

from ._direct import Address, DirectServer
from ._encoding import Failed, decode_call, encode_reply, reply_of
from ._lifeline import ActorLifeline, hold
from ._ranks import ActorInfo

__all__ = ["MONITOR_GROUP", "RayWorker", "RayWorkerActor", "WireCall"]

#: The actor's second thread: the liveness watch, so that it answers while the worker is
#: busy in a long call.
MONITOR_GROUP = "executor_monitor"

#: What :meth:`RayWorker.execute` takes: ``[method, args, kwargs, unique_reply_rank,
#: lifted_positions]``, pickled to bytes by :func:`~._encoding.pack` or, when Ray's serializer
#: carries it, as a list (not a tuple: Ray encodes lists with msgpack but pickles tuples,
#: about 7 µs more per message). ``args[i]`` for each lifted position arrives as an argument
#: of the Ray call of its own (large buffers; see :func:`~._encoding.encode_call`).
WireCall = list[Any]


class RayWorker:
    """One rank. Calls run one at a time (a lock), whether they come as actor tasks, on the
    direct socket's thread, or through a compiled graph's loop, which Ray runs on another
    thread of the actor. The core's :class:`~executor_core.backend.WorkerWrapper` runs each
    call and decides whether this rank answers."""

    def __init__(self) -> None:
        self._wrapper: WorkerWrapper | None = None
        self._rank = -1
        self._output_rank = -1
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._direct: DirectServer | None = None
        self._lifeline: ActorLifeline | None = None

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

    def free_port(self, host: str) -> int:
        """A free TCP port on this node (for the torch.distributed rendezvous)."""
        return find_free_port(host)

    def init_worker(self, wrapper: WorkerWrapper) -> Failed | None:
        """Build the user's worker (``wrapper``, from ``TransportHost.wrapper``) and run
        init_device and load_model."""
        context = wrapper.context
        self._rank = context.rank
        self._output_rank = context.world_size - context.tensor_parallel_size
        self._wrapper = wrapper
        with self._lock:
            try:
                wrapper.init_worker()
            except Exception as exc:  # noqa: BLE001 - shipped to the driver with its traceback
                return Failed(RemoteFailure.capture(context.rank, "init_worker", exc))
        return None

    def prepare_compiled(self) -> None:
        """Import what a compiled graph's loop imports (Ray's graph code, and torch when it is
        installed: seconds), so that the first step does not pay for it inside its timeout."""
        from ray.experimental.channel.common import ChannelContext

        _ = ChannelContext.get_current().torch_available

    def hold_lifeline(self, address: Address, key: bytes, timeout_s: float) -> str | None:
        """Connect to the driver's lifeline (see ``_lifeline``): from now on this process
        exits as soon as the driver's process is gone. None, or why it could not."""
        try:
            self._lifeline = hold(address, key, timeout_s)
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def open_channel(self, authkey: bytes, host: str | None = None) -> Address:
        """Listen for the driver's direct calls (see ``_direct``): on an abstract Unix socket,
        or on TCP at ``host`` (this node's IP) for a driver on another node. The address."""
        self._direct = DirectServer(authkey, self._execute_direct, host)
        return self._direct.address

    # --- calls -----------------------------------------------------------------------------

    def _execute_direct(self, call: bytes) -> Any:
        try:
            return self.execute(call)
        except Exception as exc:  # noqa: BLE001 - a call that cannot be read: the driver's error
            return Failed(RemoteFailure.capture(self._rank, "<direct call>", exc))

    def execute(self, call: WireCall | bytes, *lifted: Any) -> Any:
        """Run a :data:`WireCall`; the reply encoded by :func:`~._encoding.encode_reply`
        (``None`` when this rank need not answer, the result, or :class:`Failed`).

        The call is one argument, the same for every rank, so that Ray serialises it once per
        actor call (each actor-call argument costs tens of microseconds); only large buffers
        come as arguments of their own (``lifted``).
        """
        method, args, kwargs, reply_rank, positions = decode_call(call)
        for position, value in zip(positions, lifted, strict=True):
            args[position] = value
        return encode_reply(self._handle(method, args, kwargs, reply_rank))

    def execute_model_compiled(self, batch: Any) -> Any:
        """``execute_model`` as a compiled-graph stage: only the output rank returns a result
        (the others ``None``, or a :class:`Failed`). Unlike :meth:`execute`, the result is not
        pickled to bytes first: a graph's channel serialises a small value in about 2 µs, less
        than pickling it here would add (a Ray task result costs ~100 µs more than bytes,
        hence the bytes there)."""
        return self._handle("execute_model", (batch,), None, self._output_rank)

    def _handle(
        self,
        method: str | bytes | Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any] | None,
        reply_rank: int | None,
    ) -> Any:
        wrapper = self._wrapper
        if wrapper is None:
            error = RuntimeError(f"the worker of rank {self._rank} is not initialised")
            return Failed(RemoteFailure.capture(self._rank, "<call>", error))
        with self._lock:
            return reply_of(wrapper.handle(method, args, kwargs, reply_rank))

    # --- monitoring ------------------------------------------------------------------------

    @ray.method(concurrency_group=MONITOR_GROUP)
    def watch(self) -> None:
        """Returns when the worker shuts down; fails with ActorDiedError if the actor dies."""
        self._stopped.wait()

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
