"""torch.distributed set-up for one worker: process group, device, TP/PP sub-groups, seed."""

from __future__ import annotations

import datetime
import logging
import os
import random
import sys
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .._worker import WorkerContext

__all__ = [
    "ParallelState",
    "init_distributed",
    "leave_process_group",
    "seed_everything",
    "select_device",
]

_log = logging.getLogger("executor_core")

#: The collective backend for each device type; other device types ask torch.
_DIST_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


def _one_gpu_per_process() -> bool:
    """True when ``CUDA_VISIBLE_DEVICES`` names one device: the launcher gave this process
    a GPU of its own (Slurm's ``--gpus-per-task=1``, say)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return len([entry for entry in visible.split(",") if entry.strip()]) == 1


def select_device(context: WorkerContext) -> torch.device:
    """This worker's device: the CPU, or the GPU of its local rank (made current).

    On CUDA the worker takes ``cuda:{local_rank}`` of the GPUs it sees, and refuses a local
    rank with no GPU of its own. One exception: a process whose ``CUDA_VISIBLE_DEVICES``
    names a single GPU was given it by its launcher, and takes it whatever its local rank.
    """
    if context.device == "cpu":
        return torch.device("cpu")
    if context.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                "device='cuda' but this torch build sees no GPU "
                f"(torch {torch.__version__}); use device='cpu' or install a CUDA build"
            )
        count = torch.cuda.device_count()
        narrowed = count == 1 and _one_gpu_per_process()
        index = 0 if narrowed else context.local_rank
        if index >= count:
            raise RuntimeError(
                f"local rank {context.local_rank} of {context.local_world_size} on this node "
                f"has no GPU of its own: {count} visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
                "start at most one worker per GPU"
            )
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(context.device, context.local_rank)


def _dist_backend(device: torch.device) -> str:
    known = _DIST_BACKENDS.get(device.type)
    if known is not None:
        return known
    lookup = getattr(dist, "get_default_backend_for_device", None)  # torch 2.6 and later
    if lookup is not None:
        return str(lookup(device))
    # Earlier torch: the map that lookup reads, which a device's plugin fills when it
    # registers its collective backend.
    backend = dist.Backend.default_device_backend_map.get(device.type)
    if backend is None:
        raise ValueError(
            f"no torch.distributed backend is registered for {device.type!r} devices "
            f"(torch {torch.__version__}); import the device's torch plugin first"
        )
    return str(backend)


def _available_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


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

        For rank replacement: some ranks died and got new processes, while this rank's
        process (and its memory) survived. ``context`` is its new context: the same place in
        the job (rank, world size, TP and PP sizes) with a new ``distributed_init_method``,
        where the new ranks (which run :func:`init_distributed`) and the other survivors
        meet. Returns the new state; this one is left without groups (its :meth:`destroy`
        does nothing).

        Sends still in flight are dropped, not waited for: their receiver may be dead, and
        a wait on a dead peer can block. The process group is left with
        :func:`leave_process_group` (on gloo, a rank still blocked on it in a call with this
        one, a receive from it say, sees its call fail at once: survivors free each other).
        ``seed``, ``timeout_s`` and ``cpu_threads`` are :func:`init_distributed`'s.

        Raises ``ValueError`` if ``context`` puts this worker elsewhere (another rank, world
        size or parallel layout: a replacement keeps every survivor's place), and
        ``RuntimeError`` if the process group is not this state's own (the user's script
        made it, and only the script knows how to make it again).
        """
        old, new = self.context, context
        if (old.rank, old.world_size, old.tensor_parallel_size, old.pipeline_parallel_size) != (
            new.rank,
            new.world_size,
            new.tensor_parallel_size,
            new.pipeline_parallel_size,
        ):
            raise ValueError(
                "rejoin keeps a surviving rank's place, but this worker is rank "
                f"{old.rank} of {old.world_size} (tp={old.tensor_parallel_size}, "
                f"pp={old.pipeline_parallel_size}) and the new context says rank {new.rank} "
                f"of {new.world_size} (tp={new.tensor_parallel_size}, "
                f"pp={new.pipeline_parallel_size})"
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


def leave_process_group() -> None:
    """Leave torch.distributed's process group (and every sub-group), if this process is in
    one; a no-op otherwise.

    For a rank whose peers may have died: unlike ``torch.distributed.destroy_process_group``
    alone it does not raise for a group a dead peer broke (it logs the error), since that
    group is being thrown away. On NCCL the communicators are aborted rather than destroyed,
    as a communicator in error can hang a destroy. On gloo, a rank still blocked on the group
    in a call with this one (a receive from it, say) sees its call fail at once, as this
    rank closes its connections: survivors that leave free each other.

    Raises ``RuntimeError`` only if the process is still in a process group afterwards
    (neither teardown got it out), as joining a new one would then fail.
    """
    if not dist.is_available() or not dist.is_initialized():
        return
    backend = str(dist.get_backend())
    # A private torch function (torch.distributed.distributed_c10d): the only way torch
    # offers to tear down NCCL communicators without a collective handshake, which a
    # communicator in error (a peer died) may never complete. Private and newer than torch
    # 2.4, so a release may lack it: looked up, not assumed; without it the teardown is
    # destroy_process_group's.
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if "nccl" in backend and abort is not None:
        _leave_with("aborting", abort)
    if dist.is_initialized():
        _leave_with("destroying", dist.destroy_process_group)  # also every sub-group
    if dist.is_initialized() and abort is not None:
        # destroy_process_group raised before it let go of the group: abort clears it.
        _leave_with("aborting", abort)
    if dist.is_initialized():
        raise RuntimeError(
            f"could not leave the torch.distributed process group ({backend}): its teardown "
            "failed (logged); this process cannot join a new one"
        )


def _leave_with(what: str, teardown: Callable[[], None]) -> None:
    """Run ``teardown`` on the process group, logging (not raising) what a broken group
    raises: torch.distributed's errors (``DistError``) and the backends' ``RuntimeError``
    (gloo's "Connection closed by peer"), of which ``DistError`` is a kind."""
    try:
        teardown()
    except RuntimeError as error:
        _log.warning(
            "%s the torch.distributed process group failed, as a broken group's may: %s: %s",
            what,
            type(error).__name__,
            error,
        )


def init_distributed(
    context: WorkerContext,
    *,
    seed: int | None = None,
    timeout_s: float = 300.0,
    cpu_threads: int | None = None,
) -> ParallelState:
    """Set up torch.distributed for the worker described by ``context``.

    Picks the device (CPU, or the GPU of ``context.local_rank``), joins the process group at
    ``context.distributed_init_method`` (``tcp://host:port`` from the executor, or ``env://``
    under torchrun) with gloo on CPU and nccl on CUDA, and creates the tensor-parallel groups
    (the ranks of one stage) and pipeline-parallel groups (one TP rank across stages). A
    world of one rank needs no process group and gets none. If this process already joined a
    process group of the same size (e.g. the user's script did), it is reused and kept.

    On CPU, with several workers on this node, torch's intra-op threads are limited to
    ``cpu_threads`` (default: the available CPUs divided among the node's workers) so that
    the workers do not oversubscribe the cores. ``timeout_s`` bounds the rendezvous and
    every collective. ``seed`` (if given) seeds every generator, the same on every rank.

    Before returning it runs one collective on every group and one send between pipeline
    stages, so that communicators (NCCL's are made lazily) form now: a set-up fault raises
    here, naming the rank, instead of in the first step. On CUDA the process group is bound
    to the worker's GPU (``device_id``), and a process group the user made with a backend
    that cannot carry CUDA tensors (gloo) is refused.
    """
    device = select_device(context)
    if device.type == "cpu" and (cpu_threads is not None or context.local_world_size > 1):
        threads = cpu_threads or max(1, _available_cpus() // max(1, context.local_world_size))
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
    waited for: communicators form now, at start-up.

    NCCL forms a communicator at its first collective and a point-to-point one at the first
    send between two ranks; without this, a duplicate GPU, a bad interface or a P2P fault
    would appear in the first step (or hang it) instead of in ``create_executor``. Every rank
    runs the same sequence (world, its TP group, its PP group, the stage chain), so no
    rank waits on one that is waiting elsewhere.
    """
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


def _check_reused_backend(backend: str, device: torch.device) -> None:
    """Refuse a process group the user made whose backend cannot carry this device's
    tensors (gloo has no CUDA send/recv)."""
    if device.type != "cuda":
        return
    per_device = dict(part.split(":", 1) for part in backend.split(",") if ":" in part)
    cuda_backend = per_device.get("cuda", backend if not per_device else "")
    if cuda_backend in ("", "gloo"):
        raise RuntimeError(
            f"this process already joined a process group with backend {backend!r}, which "
            "cannot carry CUDA tensors, but the worker's device is cuda; initialise it with "
            "backend='nccl' (or 'cpu:gloo,cuda:nccl'), or use device='cpu'"
        )


def _setup_error(
    context: WorkerContext, backend: str, stage: str, error: Exception
) -> RuntimeError:
    return RuntimeError(
        f"rank {context.rank} (local rank {context.local_rank} on {context.node_id or 'its node'}"
        f"): setting up torch.distributed ({backend}) failed in {stage}: "
        f"{type(error).__name__}: {error}"
    )
