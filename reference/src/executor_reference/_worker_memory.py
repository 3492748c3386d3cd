"""A rank's memory, given back and taken again: ``sleep`` offloads or drops the weights and
drops the KV cache, ``wake_up`` restores what it is asked to, ``memory_usage`` says what is
held."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from executor_core import SLEEP_TAGS, SleepStateError
from executor_core.torch import (
    device_memory,
    host_memory_bytes,
    pinned_host_bytes,
    trim_host_memory,
)

from ._worker_setup import WorkerSetup

__all__ = ["WorkerMemory"]


class WorkerMemory(WorkerSetup):
    """The memory of :class:`~executor_reference.ReferenceWorker`'s rank: what sleep frees,
    wake restores, the report counts."""

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
