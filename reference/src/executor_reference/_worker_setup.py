"""One rank's model setup: its options checked, torch.distributed joined, its shard of the
checkpoint read into its pipeline stage, a KV cache allocated; all of it released at
shutdown."""

from __future__ import annotations

import collections
from pathlib import Path

import torch

from executor_core import WorkerBase, WorkerContext
from executor_core.torch import ParallelState, TensorOffloader, init_distributed

from ._checkpoint import load_shard, read_config, stage_tensor_names, tensor_nbytes
from ._model import KVCache, StageModel

__all__ = ["SPMD_BACKENDS", "STEP_TIMES_KEPT", "WorkerSetup"]

#: Backends where every rank runs its own driver loop, so every rank needs the step output.
SPMD_BACKENDS: frozenset[str] = frozenset({"external_launcher"})

#: Steps whose timing a worker keeps until the driver takes them (the oldest are dropped).
STEP_TIMES_KEPT = 16384


class WorkerSetup(WorkerBase):
    """One rank's setup, the base of :class:`~executor_reference.ReferenceWorker` (which
    documents its options): what ``__init__``, ``init_device`` and ``load_model`` build,
    ``shutdown`` releases."""

    def __init__(
        self,
        *,
        context: WorkerContext,
        checkpoint: str,
        kv_slots: int = 32,
        seed: int = 0,
        distributed_timeout_s: float = 300.0,
        offload_dir: str | None = None,
        cpu_threads: int | None = None,
    ) -> None:
        super().__init__(context=context)
        if not Path(checkpoint).is_file():
            raise FileNotFoundError(
                f"reference checkpoint {checkpoint!r} does not exist on rank {context.rank}; "
                "create it with executor_reference.ensure_checkpoint (on a path every "
                "worker can read)"
            )
        if kv_slots < 1:
            raise ValueError(f"kv_slots must be >= 1, not {kv_slots}")
        self.checkpoint = checkpoint
        self.kv_slots = kv_slots
        self.seed = seed
        self.distributed_timeout_s = distributed_timeout_s
        self.offload_dir = offload_dir
        self.cpu_threads = cpu_threads
        self.config = read_config(checkpoint)
        self.config.check_parallel(context.tensor_parallel_size, context.pipeline_parallel_size)
        self.spmd = context.backend in SPMD_BACKENDS
        self.state: ParallelState | None = None
        self.model: StageModel | None = None
        self.kv_cache: KVCache | None = None
        self.offloader: TensorOffloader | None = None
        #: What load_model read from the checkpoint: tensor name -> shape of this rank's part.
        self.loaded_shapes: dict[str, tuple[int, ...]] = {}
        #: Bytes load_model read from the checkpoint.
        self.loaded_bytes = 0
        #: How many times load_model ran in this process (once: a rank replacement's
        #: survivors keep their weights).
        self.model_loads = 0
        self._asleep: set[str] = set()
        self._sleep_level = 0
        #: ``(batch_id, start_pos, started_at, finished_at)`` of each step this rank ran.
        self._step_times: collections.deque[tuple[int, int, float, float]] = collections.deque(
            maxlen=STEP_TIMES_KEPT
        )

    # --- lifecycle --------------------------------------------------------------------------

    def init_device(self) -> None:
        """Join torch.distributed and create the TP/PP groups."""
        self.state = init_distributed(
            self.context,
            seed=self.seed,
            timeout_s=self.distributed_timeout_s,
            cpu_threads=self.cpu_threads,
        )
        self.offloader = TensorOffloader(self.state.device, directory=self.offload_dir)

    def rejoin(self, context: WorkerContext) -> None:
        """Rebuild the distributed groups in ``context`` after the executor replaced dead
        ranks, keeping this rank's weights, KV cache and offloader.

        The weights are not read from the checkpoint again: this rank's process survived, and
        only its groups broke. Works asleep as awake, since only the groups change (what is
        offloaded stays with the offloader, on the same device).
        """
        state = self._require_state()
        self.state = state.rejoin(
            context,
            seed=self.seed,
            timeout_s=self.distributed_timeout_s,
            cpu_threads=self.cpu_threads,
        )
        if self.model is not None:
            self.model.use_state(self.state)
        self.context = context

    def _require_state(self) -> ParallelState:
        if self.state is None:
            raise RuntimeError("init_device has not run on this worker")
        return self.state

    def _read_shard(self) -> dict[str, torch.Tensor]:
        state = self._require_state()
        names = stage_tensor_names(self.config, state.pp_size, state.pp_rank)
        return load_shard(
            self.checkpoint,
            self.config,
            names,
            tp_rank=state.tp_rank,
            tp_size=state.tp_size,
            device=state.device,
        )

    def load_model(self) -> None:
        """Build this rank's stage, read its shard, allocate the KV cache."""
        state = self._require_state()
        self.model = StageModel(self.config, state)
        shard = self._read_shard()
        self.loaded_shapes = {name: tuple(t.shape) for name, t in shard.items()}
        self.loaded_bytes = tensor_nbytes(shard)
        self.model_loads += 1
        self.model.load_state_dict(shard, strict=True, assign=True)
        self._allocate_kv_cache()

    def _allocate_kv_cache(self) -> None:
        state = self._require_state()
        assert self.model is not None
        self.kv_cache = KVCache(
            self.config,
            num_layers=len(self.model.layer_ids),
            num_slots=self.kv_slots,
            tp_size=state.tp_size,
            device=state.device,
        )

    def shutdown(self) -> None:
        """Release the groups, the offload file, the model."""
        self.model = None
        self.kv_cache = None
        if self.offloader is not None:
            self.offloader.close()
        state, self.state = self.state, None
        if state is not None:
            state.destroy()

    def _weights(self) -> dict[str, torch.nn.Parameter]:
        assert self.model is not None
        return dict(self.model.named_parameters())

    def loaded_shard(self) -> dict[str, tuple[int, ...]]:
        """What load_model read: tensor name -> shape of this rank's part."""
        return dict(self.loaded_shapes)

    def weights_state(self) -> dict[str, torch.Tensor]:
        """A CPU copy of this rank's weights, by checkpoint name (for checks and tests)."""
        return {name: p.detach().cpu().clone() for name, p in self._weights().items()}
