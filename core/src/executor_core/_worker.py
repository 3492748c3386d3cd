"""WorkerBase, what users subclass, and WorkerContext, what a worker knows about its place."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import attrs

__all__ = ["SLEEP_TAGS", "WorkerBase", "WorkerContext"]

#: What ``sleep`` releases and what ``wake_up(tags)`` may restore, one tag at a time.
SLEEP_TAGS: tuple[str, ...] = ("weights", "kv_cache")


@attrs.frozen(kw_only=True)
class WorkerContext:
    """A worker's place in the job. Built by the executor, handed to the worker's constructor."""

    #: Global rank, ``pp_rank * tensor_parallel_size + tp_rank``.
    rank: int
    #: Rank among the workers on this node (selects the device).
    local_rank: int
    world_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    #: Rendezvous for ``torch.distributed`` (``tcp://host:port`` or ``env://``).
    distributed_init_method: str
    #: Device type (``"cpu"``, ``"cuda"``, or a device plugin's).
    device: str = "cpu"
    #: Workers on this node.
    local_world_size: int = 1
    #: Identifier of the node (hostname, Ray node id, ...).
    node_id: str = ""
    #: The node's address, as its agent states it (``executor node --address``); empty
    #: where the backend does not know one (every rank on the driver's machine, say).
    node_address: str = ""
    #: Name of the backend that started the worker.
    backend: str = ""

    @property
    def tp_rank(self) -> int:
        """Rank inside this worker's tensor-parallel group."""
        return self.rank % self.tensor_parallel_size

    @property
    def pp_rank(self) -> int:
        """Pipeline stage of this worker."""
        return self.rank // self.tensor_parallel_size

    @property
    def is_output_rank(self) -> bool:
        """True for the rank whose ``execute_model`` result the executor returns."""
        return self.rank == self.world_size - self.tensor_parallel_size


class WorkerBase:
    """The unit of work an executor hosts, one per rank. Subclass it.

    The executor builds it inside the worker process as ``cls(context=ctx, **worker_kwargs)``,
    then calls :meth:`init_device` and :meth:`load_model` before the executor is ready
    (and :meth:`rejoin` on a rank that survived while the executor replaced dead ones).
    Any public method can be called from the driver with ``collective_rpc("name", ...)``.
    """

    def __init__(self, *, context: WorkerContext, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(
                f"{type(self).__name__} got unexpected worker_kwargs {sorted(kwargs)}; "
                "accept them in your subclass's __init__"
            )
        self.context = context

    @property
    def rank(self) -> int:
        """Global rank."""
        return self.context.rank

    @property
    def local_rank(self) -> int:
        """Rank on this node."""
        return self.context.local_rank

    @property
    def world_size(self) -> int:
        """Total workers."""
        return self.context.world_size

    @property
    def tp_rank(self) -> int:
        """Rank inside the tensor-parallel group."""
        return self.context.tp_rank

    @property
    def pp_rank(self) -> int:
        """Pipeline stage."""
        return self.context.pp_rank

    @property
    def distributed_init_method(self) -> str:
        """Rendezvous address for ``torch.distributed``."""
        return self.context.distributed_init_method

    def init_device(self) -> None:
        """Select and set up this worker's device (and its distributed groups). Default: nothing.

        The accelerator device current at the end of :meth:`load_model` (CUDA's, or another
        torch accelerator's) is made current on every thread that later runs one of this
        worker's methods: backends run calls on threads of their own.
        """

    def load_model(self) -> None:
        """Load this rank's model or shard. Default: nothing."""

    def rejoin(self, context: WorkerContext) -> None:
        """Rejoin the job in ``context`` after the executor replaced dead ranks.

        Called on a surviving rank when recovery replaces only the ranks that died
        (recovery kind ``"replace"``): the new ranks get new processes, which run
        :meth:`init_device` and :meth:`load_model` (``rejoin`` is not called on them), while
        this rank keeps its process and its memory (weights included) and only rebuilds its
        distributed groups with them. ``context`` is this rank's new context: the same place
        (rank, world size, parallel sizes) with a new ``distributed_init_method``, where
        every rank of the job meets.

        Default: leave the broken process group, if this process imported
        ``torch.distributed`` (:func:`executor_core.torch.leave_process_group`; on gloo, a
        rank blocked on the old group is freed as its peers leave it), take ``context`` as
        :attr:`context`, then run :meth:`init_device` again, which joins the new group.
        :meth:`load_model` is not run again. A worker whose :meth:`init_device` does more
        than join groups (allocates buffers, loads weights) overrides this method, to keep
        what it has.
        """
        # Only a process that uses torch.distributed can be in a group; importing torch
        # here would add seconds (and a dependency) to workers that never use it.
        if "torch.distributed" in sys.modules:
            try:
                from executor_core.torch import leave_process_group
            except ImportError as exc:
                raise ImportError(
                    f"{type(self).__name__}.rejoin leaves torch.distributed's process group "
                    "with executor_core.torch, which needs the core's torch extra: "
                    f"pip install 'executor-core[torch]' ({exc})"
                ) from exc
            leave_process_group()
        self.context = context
        self.init_device()

    def execute_model(self, batch: Any) -> Any:
        """Run one step on ``batch`` and return the output (only the output rank's is returned)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement execute_model")

    def sleep(self, level: int = 1) -> None:
        """Release memory: level 1 offloads weights and drops caches; level 2 drops both."""

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore what :meth:`sleep` released: all of it, or only ``tags`` (see SLEEP_TAGS)."""

    def check_health(self) -> None:
        """Raise if this worker is unhealthy. Default: healthy."""

    def shutdown(self) -> None:
        """Release this worker's resources. Called once, before the process or actor ends."""
