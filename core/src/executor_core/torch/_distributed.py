"""torch.distributed set-up for one worker: process group, device, TP/PP sub-groups, seed."""

from __future__ import annotations

import datetime
import logging
import os
import random
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ._devices import _check_reused_backend, _dist_backend, select_device
from ._leave import leave_process_group

if TYPE_CHECKING:
    from .._worker import WorkerContext

__all__ = [
    "ParallelState",
    "init_distributed",
    "seed_everything",
]

_log = logging.getLogger("executor_core")


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's (if loaded) and torch's generators, on every device."""
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


class ParallelState:
    """A worker's distributed state: its device and its tensor- and pipeline-parallel groups.

    With one rank in a group the matching collectives are no-ops, so the same model code runs
    unchanged from one process to many. Build it with :func:`init_distributed`.
    """

    def __init__(
        self,
        context: WorkerContext,
        device: torch.device,
        *,
        backend: str,
        tp_group: dist.ProcessGroup | None,
        pp_group: dist.ProcessGroup | None,
        owns_process_group: bool,
        created_groups: Sequence[dist.ProcessGroup] = (),
    ) -> None:
        self.context = context
        self.device = device
        #: The torch.distributed backend ("gloo", "nccl"), or "" when no group was needed.
        self.backend = backend
        self.tp_group = tp_group
        self.pp_group = pp_group
        self._owns_process_group = owns_process_group
        self._created_groups = list(created_groups)
        self._pending_sends: list[tuple[dist.Work, torch.Tensor]] = []

    # --- where this rank sits -------------------------------------------------------------

    @property
    def rank(self) -> int:
        """Global rank."""
        return self.context.rank

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self.context.world_size

    @property
    def tp_rank(self) -> int:
        """Rank inside the tensor-parallel group."""
        return self.context.tp_rank

    @property
    def tp_size(self) -> int:
        """Ranks per tensor-parallel group."""
        return self.context.tensor_parallel_size

    @property
    def pp_rank(self) -> int:
        """Pipeline stage."""
        return self.context.pp_rank

    @property
    def pp_size(self) -> int:
        """Pipeline stages."""
        return self.context.pipeline_parallel_size

    @property
    def is_first_stage(self) -> bool:
        """True on the first pipeline stage (it embeds the tokens)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """True on the last pipeline stage (it computes the logits)."""
        return self.pp_rank == self.pp_size - 1

    @property
    def output_rank(self) -> int:
        """The first TP rank of the last stage: the rank whose output the executor returns."""
        return self.world_size - self.tp_size

    # --- collectives ----------------------------------------------------------------------

    def tp_all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` in place over the tensor-parallel group and return it."""
        if self.tp_size > 1:
            dist.all_reduce(tensor, group=self.tp_group)
        return tensor

    def tp_all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every TP rank's ``tensor`` along ``dim``, in TP-rank order."""
        if self.tp_size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.tp_size)]
        dist.all_gather(parts, tensor, group=self.tp_group)
        return torch.cat(parts, dim=dim)

    def send_to_next_stage(self, tensor: torch.Tensor) -> None:
        """Send ``tensor`` to the same TP rank of the next stage without waiting for it.

        The send completes in the background; :meth:`wait_for_sends` (called before the next
        send and at teardown) waits for earlier sends and releases their buffers.
        """
        if self.is_last_stage:
            raise RuntimeError("the last pipeline stage has no next stage to send to")
        self.wait_for_sends()
        tensor = tensor.contiguous()
        work = dist.isend(tensor, dst=self.rank + self.tp_size)
        if work is not None:
            self._pending_sends.append((work, tensor))

    def recv_from_prev_stage(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Receive the tensor the same TP rank of the previous stage sent (blocking)."""
        if self.is_first_stage:
            raise RuntimeError("the first pipeline stage has no previous stage to receive from")
        buffer = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        dist.recv(buffer, src=self.rank - self.tp_size)
        return buffer

    def wait_for_sends(self) -> None:
        """Wait for every send still in flight."""
        pending, self._pending_sends = self._pending_sends, []
        for work, _buffer in pending:
            work.wait()

    def broadcast_from(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with rank ``src``'s (no-op with one rank)."""
        if self.world_size > 1:
            dist.broadcast(tensor, src=src)
        return tensor

    # --- teardown -------------------------------------------------------------------------

    def destroy(self) -> None:
        """Release the groups this state created (and the process group, if it made it)."""
        if not dist.is_initialized():
            self._created_groups.clear()
            return
        try:
            self.wait_for_sends()
        finally:
            groups, self._created_groups = self._created_groups, []
            if self._owns_process_group:
                dist.destroy_process_group()  # also destroys every sub-group
            else:
                for group in groups:
                    dist.destroy_process_group(group)
            self.tp_group = self.pp_group = None

    def rejoin(
        self,
        context: WorkerContext,
        *,
        seed: int | None = None,
        timeout_s: float = 300.0,
        cpu_threads: int | None = None,
    ) -> ParallelState:
        """Leave this rank's broken process group and join the new one at ``context``.

        For rank replacement: some ranks died and got new processes, while this one survived.
        ``context`` keeps its place in the job (rank, world size, TP and PP sizes) with a new
        ``distributed_init_method``, where the new ranks (running :func:`init_distributed`)
        and the other survivors meet. Returns the new state; this one is left without groups.

        Sends in flight are dropped, not waited for (their receiver may be dead), and the
        process group is left with :func:`leave_process_group`. ``seed``, ``timeout_s`` and
        ``cpu_threads`` are :func:`init_distributed`'s. Raises ``ValueError`` if ``context``
        moves this worker, and ``RuntimeError`` if the process group is the user's script's
        (only the script knows how to make it again).
        """

        def place(c: WorkerContext) -> str:
            tp, pp = c.tensor_parallel_size, c.pipeline_parallel_size
            return f"rank {c.rank} of {c.world_size} (tp={tp}, pp={pp})"

        if place(self.context) != place(context):
            raise ValueError(
                f"rejoin keeps a surviving rank's place, but this worker is {place(self.context)} "
                f"and the new context says {place(context)}"
            )
        if self.world_size > 1 and not self._owns_process_group:
            raise RuntimeError(
                f"rank {self.rank} cannot rejoin: it uses a process group this process made "
                "before init_distributed (the user's), which only its maker can make again; "
                "rank replacement needs the executor to own the process group (let "
                "init_distributed create it)"
            )
        # Dropped, not waited for: wait_for_sends on a send to a dead rank can block.
        self._pending_sends.clear()
        self._created_groups.clear()
        self.tp_group = self.pp_group = None
        if self._owns_process_group:
            leave_process_group()
            # The process group is the new state's from here: destroy() on this one (a
            # stale reference) must not tear it down.
            self._owns_process_group = False
        return init_distributed(context, seed=seed, timeout_s=timeout_s, cpu_threads=cpu_threads)


def init_distributed(
    context: WorkerContext,
    *,
    seed: int | None = None,
    timeout_s: float = 300.0,
    cpu_threads: int | None = None,
) -> ParallelState:
    """Set up torch.distributed for the worker described by ``context``.

    Picks the device (:func:`select_device`), joins the process group at
    ``context.distributed_init_method`` (``tcp://host:port`` from the executor, or ``env://``
    under torchrun) with gloo on CPU and nccl on CUDA (bound to the worker's GPU), and
    creates the tensor-parallel groups (the ranks of one stage) and pipeline-parallel groups
    (one TP rank across stages). A world of one rank gets no process group. One this process
    already joined with the same size (the user's script's) is reused and kept, unless its
    backend cannot carry CUDA tensors (gloo) and the device is CUDA.

    On CPU, with several workers on this node, torch's intra-op threads are limited to
    ``cpu_threads`` (default: the available CPUs divided among the node's workers).
    ``timeout_s`` bounds the rendezvous and every collective. ``seed`` (if given) seeds every
    generator, the same on every rank. A warm-up collective on every group forms the
    communicators now: a set-up fault raises here, naming the rank, not in the first step.
    """
    device = select_device(context)
    if device.type == "cpu" and (cpu_threads is not None or context.local_world_size > 1):
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        threads = cpu_threads or max(1, (cpus or 1) // max(1, context.local_world_size))
        torch.set_num_threads(threads)
    if seed is not None:
        seed_everything(seed)

    tp, pp = context.tensor_parallel_size, context.pipeline_parallel_size
    if context.world_size == 1 and not dist.is_initialized():
        return ParallelState(
            context, device, backend="", tp_group=None, pp_group=None, owns_process_group=False
        )

    backend = _dist_backend(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    if dist.is_initialized():
        if dist.get_world_size() != context.world_size or dist.get_rank() != context.rank:
            raise RuntimeError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but this worker is rank {context.rank} of "
                f"{context.world_size}; destroy the existing process group first"
            )
        owns = False
        backend = str(dist.get_backend())
        _check_reused_backend(backend, device)
    else:
        init_method = context.distributed_init_method
        if init_method == "env://":
            missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
            if missing:
                raise RuntimeError(
                    f"distributed_init_method is env:// but {', '.join(missing)} is not set; "
                    "start the processes with torchrun (which sets them) or set them yourself"
                )
        # With device_id, NCCL builds the communicator now (eager init), so a bad interface
        # or a GPU fault fails here rather than in the first step.
        device_id = device if device.type == "cuda" else None
        try:
            dist.init_process_group(
                backend=backend,
                init_method=init_method,
                rank=context.rank,
                world_size=context.world_size,
                timeout=timeout,
                device_id=device_id,
            )
        except Exception as exc:
            raise _setup_error(context, backend, "joining the process group", exc) from exc
        owns = True

    # Every rank creates every group, in the same order, as torch requires.
    created: list[dist.ProcessGroup] = []
    tp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    if tp > 1:
        for stage in range(pp):
            group = dist.new_group([stage * tp + t for t in range(tp)], timeout=timeout)
            created.append(group)
            if stage == context.pp_rank:
                tp_group = group
    if pp > 1:
        for tp_rank in range(tp):
            group = dist.new_group([s * tp + tp_rank for s in range(pp)], timeout=timeout)
            created.append(group)
            if tp_rank == context.tp_rank:
                pp_group = group
    state = ParallelState(
        context,
        device,
        backend=backend,
        tp_group=tp_group,
        pp_group=pp_group,
        owns_process_group=owns,
        created_groups=created,
    )
    try:
        _warm_up(state)
    except Exception as exc:
        if device.type != "cuda":
            # NCCL's teardown can itself hang on a communicator in error; the worker's
            # process goes when create_executor fails, and its groups with it.
            state.destroy()
        raise _setup_error(context, backend, "the warm-up collectives", exc) from exc
    return state


def _warm_up(state: ParallelState) -> None:
    """One collective on every group this rank is in and one hop between pipeline stages,
    waited for: NCCL forms its communicators lazily, so a duplicate GPU, a bad interface or a
    P2P fault would otherwise appear in the first step (or hang it). Every rank runs the same
    sequence (world, its TP group, its PP group, the stage chain): none waits on another."""
    probe = torch.zeros(1, device=state.device)
    dist.all_reduce(probe)
    for group in (state.tp_group, state.pp_group):
        if group is not None:
            dist.all_reduce(probe, group=group)
    if state.pp_size > 1:
        if not state.is_last_stage:
            state.send_to_next_stage(probe)
        if not state.is_first_stage:
            state.recv_from_prev_stage(probe.shape, probe.dtype)
        state.wait_for_sends()
    if state.device.type == "cuda":
        torch.cuda.synchronize(state.device)


def _setup_error(
    context: WorkerContext, backend: str, stage: str, error: Exception
) -> RuntimeError:
    return RuntimeError(
        f"rank {context.rank} (local rank {context.local_rank} on {context.node_id or 'its node'}"
        f"): setting up torch.distributed ({backend}) failed in {stage}: "
        f"{type(error).__name__}: {error}"
    )
