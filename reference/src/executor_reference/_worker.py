"""ReferenceWorker, the reference model's ``worker_cls``: one step of a batch through this
rank's pipeline stage, timed until the device has run it.

It builds on its setup (``_worker_setup.py``: the distributed groups, the shard, the KV
cache) and its memory (``_worker_memory.py``: sleep, wake, the memory report).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from executor_core import SleepStateError

from ._step import StepInput, StepOutput
from ._worker_memory import WorkerMemory

__all__ = ["ReferenceWorker"]


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


class ReferenceWorker(WorkerMemory):
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
