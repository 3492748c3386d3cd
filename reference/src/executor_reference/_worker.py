"""ReferenceWorker: hosts one rank's shard of the reference model, with a KV cache and
sleep/wake that really release memory."""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from executor_core import SLEEP_TAGS, SleepStateError, WorkerBase, WorkerContext
from executor_core.torch import (
    ParallelState,
    TensorOffloader,
    device_memory,
    host_memory_bytes,
    init_distributed,
    pinned_host_bytes,
    trim_host_memory,
)

from ._checkpoint import load_shard, read_config, stage_tensor_names, tensor_nbytes
from ._model import KVCache, StageModel

__all__ = ["SPMD_BACKENDS", "ReferenceWorker", "StepInput", "StepOutput"]

#: Backends where every rank runs its own driver loop, so every rank needs the step output.
SPMD_BACKENDS: frozenset[str] = frozenset({"external_launcher"})

#: Steps whose timing a worker keeps until the driver takes them (the oldest are dropped).
STEP_TIMES_KEPT = 16384


def _wait_for_device(device: torch.device) -> None:
    """Return once ``device`` has run the work queued so far on its current stream.

    A GPU runs kernels after the host has queued them, so a clock read when ``forward``
    returns would stop at the last launch and leave the GPU's compute to whoever reads the
    clock next (the driver would count it as executor time). On the CPU an operation is done
    when it returns: nothing to wait for, and nothing is paid. On CUDA only the current
    stream is waited for: the step's kernels, its collectives (the current stream waits for
    NCCL's) and the data it received run there, while a send to the next pipeline stage
    runs on NCCL's own stream and finishes in the background by design (waiting for it would
    make this stage's clock wait for the next stage to receive).
    """
    if device.type == "cpu":
        return
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
        return
    # Other accelerators: their module's device-wide synchronize, where torch has one.
    synchronize = getattr(getattr(torch, device.type, None), "synchronize", None)
    if synchronize is not None:
        synchronize()


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _int_rows(rows: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(_int_tuple(row) for row in rows)


@attrs.frozen(kw_only=True)
class StepInput:
    """One step of one batch: the new tokens of each of its sequences.

    All sequences of a batch advance together: ``token_ids`` is ``[batch][new tokens]``, the
    prompt on the first step (prefill) and one token per sequence after that (decode), placed
    at positions ``start_pos ..``. ``slots`` are the KV-cache slots of the sequences.
    """

    batch_id: int
    slots: tuple[int, ...] = attrs.field(converter=_int_tuple)
    token_ids: tuple[tuple[int, ...], ...] = attrs.field(converter=_int_rows)
    start_pos: int
    #: Return the last position's logits (float32, on the CPU) as well as the next tokens.
    return_logits: bool = False


@attrs.frozen(kw_only=True)
class StepOutput:
    """What the output rank returns for one step: the greedy next token of each sequence."""

    batch_id: int
    next_tokens: tuple[int, ...]
    logits: torch.Tensor | None
    #: Seconds the output rank spent inside execute_model, up to when its device had finished
    #: the step (on a GPU, the kernels' end, not their launch).
    model_time_s: float
    #: ``time.perf_counter()`` on the output rank when the step started and ended (comparable
    #: with the driver's clock on the same host only); the end is read after the device
    #: finished the step.
    started_at: float
    finished_at: float


class ReferenceWorker(WorkerBase):
    """One rank of the reference model.

    ``init_device`` joins torch.distributed; ``load_model`` reads this rank's shard (its
    pipeline stage's tensors, its TP slice of each) from the safetensors ``checkpoint`` and
    allocates a KV cache of ``kv_slots`` sequences. ``execute_model`` takes a
    :class:`StepInput` and returns a :class:`StepOutput` on the output rank (``None`` on
    others; on SPMD backends such as ``external_launcher`` every rank returns it).

    ``cpu_threads`` sets torch's intra-op threads on the CPU (default: the CPUs divided among
    the node's workers; 1 is fastest for the small sizes, whose operations are too small to
    split).

    ``sleep(1)`` offloads the weights (to an anonymous file on the CPU, pinned host memory on
    a GPU, given back to the OS on wake) and drops the KV cache; ``sleep(2)`` drops both and
    ``wake_up`` reloads the weights from the checkpoint. A sleep that fails (the host cannot
    pin the weights, the disk is full) leaves the worker awake as it was, able to sleep
    again. :meth:`memory_usage` says what that freed, on the host and on the device.

    Step timing (``model_time_s``, :meth:`take_step_times`) ends when the device has finished
    the step: on a GPU the clock is read after a synchronisation of the current stream.
    """

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

    # --- inference --------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """The model config, KV-cache capacity and this rank's place (for the driver)."""
        state = self._require_state()
        assert self.model is not None
        return {
            "model_config": self.config.to_json(),
            "kv_slots": self.kv_slots,
            "max_seq_len": self.config.max_seq_len,
            "rank": self.rank,
            "layers": list(self.model.layer_ids),
            "device": str(state.device),
            "dist_backend": state.backend,
            "torch_threads": torch.get_num_threads(),
            "pid": os.getpid(),
        }

    def take_step_times(self) -> dict[str, Any]:
        """This rank's pipeline and TP rank, and ``(batch_id, start_pos, started_at,
        finished_at)`` (``time.perf_counter``) of each step it ran since the last call (up to
        the last :data:`STEP_TIMES_KEPT`); clears them. :func:`generate` uses them to find
        which rank's start was late."""
        state = self._require_state()
        steps = list(self._step_times)
        self._step_times.clear()
        return {"pp_rank": state.pp_rank, "tp_rank": state.tp_rank, "steps": steps}

    def execute_model(self, batch: Any) -> StepOutput | None:
        """Run one step of ``batch`` (a :class:`StepInput`) through this rank's stage."""
        started = time.perf_counter()
        if not isinstance(batch, StepInput):
            raise TypeError(f"execute_model takes a StepInput, not {type(batch).__name__}")
        if self._asleep:
            raise SleepStateError(
                f"rank {self.rank} is asleep ({', '.join(sorted(self._asleep))}); "
                "call executor.wake_up() before execute_model"
            )
        state, model, cache = self._require_state(), self.model, self.kv_cache
        assert model is not None, "load_model has run"
        assert cache is not None, "awake, so the KV cache exists"
        step = batch
        size = len(step.slots)
        length = len(step.token_ids[0]) if step.token_ids else 0
        if length == 0 or any(len(row) != length for row in step.token_ids):
            raise ValueError("every sequence of a step must bring the same number (>= 1) of tokens")
        if len(step.token_ids) != size:
            raise ValueError(f"{size} slots but {len(step.token_ids)} token rows")
        if step.start_pos < 0 or step.start_pos + length > self.config.max_seq_len:
            raise ValueError(
                f"positions {step.start_pos}..{step.start_pos + length - 1} exceed the model's "
                f"max_seq_len={self.config.max_seq_len}"
            )
        if any(not 0 <= s < cache.num_slots for s in step.slots):
            raise ValueError(f"slots {step.slots} outside the KV cache's 0..{cache.num_slots - 1}")
        device = state.device
        slots = torch.tensor(step.slots, dtype=torch.long, device=device)
        with torch.inference_mode():
            if state.is_first_stage:
                inputs = torch.tensor(step.token_ids, dtype=torch.long, device=device)
            else:
                inputs = state.recv_from_prev_stage(
                    (size, length, self.config.hidden_size), getattr(torch, self.config.dtype)
                )
            out = model(inputs, cache, slots, step.start_pos)
            if not state.is_last_stage:
                state.send_to_next_stage(out)
                logits: torch.Tensor | None = None
                tokens: torch.Tensor | None = None
            else:
                logits = out.float()
                tokens = logits.argmax(dim=-1)
            if self.spmd:
                logits, tokens = self._share_output(step, logits, tokens)
        # The step ends when the device has run it, not when its kernels were queued.
        _wait_for_device(device)
        finished = time.perf_counter()
        self._step_times.append((step.batch_id, step.start_pos, started, finished))
        if tokens is None or not (self.spmd or self.rank == state.output_rank):
            return None
        return StepOutput(
            batch_id=step.batch_id,
            next_tokens=tuple(int(t) for t in tokens.tolist()),
            logits=logits.cpu() if (step.return_logits and logits is not None) else None,
            model_time_s=finished - started,
            started_at=started,
            finished_at=finished,
        )

    def _share_output(
        self, step: StepInput, logits: torch.Tensor | None, tokens: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """SPMD: every rank's driver needs the step output, so the output rank broadcasts it."""
        state = self._require_state()
        size = len(step.slots)
        if tokens is None:
            tokens = torch.empty(size, dtype=torch.long, device=state.device)
        state.broadcast_from(tokens, src=state.output_rank)
        if step.return_logits:
            if logits is None:
                logits = torch.empty(
                    (size, self.config.vocab_size), dtype=torch.float32, device=state.device
                )
            state.broadcast_from(logits, src=state.output_rank)
        return logits, tokens

    # --- sleep and wake ---------------------------------------------------------------------

    def _weights(self) -> dict[str, torch.nn.Parameter]:
        assert self.model is not None
        return dict(self.model.named_parameters())

    def _release(self) -> None:
        """Return freed memory to the OS (host) or the driver (GPU) so that it shows."""
        state = self._require_state()
        if state.device.type == "cuda":
            torch.cuda.empty_cache()
        trim_host_memory()

    def sleep(self, level: int = 1) -> None:
        """Level 1: offload the weights, drop the KV cache. Level 2: drop both (the weights
        are read from the checkpoint again on wake).

        The offload comes first and changes nothing if it fails (the offloader rolls back),
        so a failed sleep raises with the worker still awake and able to sleep again.
        """
        if level not in (1, 2):
            raise SleepStateError(f"sleep level must be 1 or 2, not {level!r}")
        if self._asleep:
            return
        state = self._require_state()
        state.wait_for_sends()
        weights = self._weights()
        if level == 1:
            assert self.offloader is not None
            self.offloader.offload({name: p.data for name, p in weights.items()})
        empty = torch.empty(0, device=state.device)
        for param in weights.values():
            param.data = empty
        self.kv_cache = None
        self._sleep_level = level
        self._asleep = set(SLEEP_TAGS)
        self._release()

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore the weights, the KV cache, or both (the default)."""
        wanted = list(SLEEP_TAGS) if tags is None else list(tags)
        unknown = [t for t in wanted if t not in SLEEP_TAGS]
        if unknown:
            raise SleepStateError(f"unknown sleep tags {unknown}; known: {list(SLEEP_TAGS)}")
        if "weights" in wanted and "weights" in self._asleep:
            if self._sleep_level == 1:
                assert self.offloader is not None
                restored = self.offloader.restore()
            else:
                restored = self._read_shard()
            for name, param in self._weights().items():
                param.data = restored[name]
            self._asleep.discard("weights")
        if "kv_cache" in wanted and "kv_cache" in self._asleep:
            self._allocate_kv_cache()
            self._asleep.discard("kv_cache")
        if not self._asleep:
            self._sleep_level = 0

    def memory_usage(self) -> dict[str, int]:
        """Bytes held now.

        - ``host_bytes``: the process's host memory (USS, else RSS).
        - ``device_bytes``: what this process holds on its device: on a GPU, the bytes torch's
          allocator reserved (``torch.cuda.memory_reserved``: live tensors and its cache,
          what sleep gives back); on the CPU, ``host_bytes``.
        - ``device_allocated_bytes``: of those, the bytes in live tensors.
        - ``device_used_bytes`` and ``device_total_bytes``: the whole device, every process
          and the CUDA context and NCCL buffers included (``torch.cuda.mem_get_info``); on
          the CPU, the host's.
        - ``pinned_host_bytes``: pinned host memory torch holds (a sleeping GPU worker's
          weights); 0 on the CPU; absent where torch does not report it.
        - ``weight_bytes``, ``kv_cache_bytes``: the weights and KV cache on the device now.
        - ``offloaded_bytes``: the weights the offloader holds (asleep at level 1).
        - ``loaded_bytes``: what load_model read from the checkpoint.

        See :class:`~executor_core.torch.DeviceMemory`.
        """
        state = self._require_state()
        weights = sum(p.numel() * p.element_size() for p in self._weights().values())
        device = device_memory(state.device)
        usage = {
            # On the CPU the device is the host: one measurement (USS is slow to read).
            "host_bytes": device.reserved_bytes
            if state.device.type == "cpu"
            else host_memory_bytes(),
            "device_bytes": device.reserved_bytes,
            "device_allocated_bytes": device.allocated_bytes,
            "device_used_bytes": device.used_bytes,
            "device_total_bytes": device.total_bytes,
            "weight_bytes": weights,
            "kv_cache_bytes": self.kv_cache.nbytes if self.kv_cache is not None else 0,
            "offloaded_bytes": self.offloader.offloaded_bytes if self.offloader else 0,
            "loaded_bytes": self.loaded_bytes,
        }
        pinned = pinned_host_bytes()
        if pinned is not None:
            usage["pinned_host_bytes"] = pinned
        return usage

    def loaded_shard(self) -> dict[str, tuple[int, ...]]:
        """What load_model read: tensor name -> shape of this rank's part."""
        return dict(self.loaded_shapes)

    def weights_state(self) -> dict[str, torch.Tensor]:
        """A CPU copy of this rank's weights, by checkpoint name (for checks and tests)."""
        return {name: p.detach().cpu().clone() for name, p in self._weights().items()}
