"""How much memory a worker holds: process USS/RSS on the host, allocator bytes on a GPU."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
from collections.abc import Callable, Sequence

import psutil  # type: ignore[import-untyped]  # psutil ships no type information
import torch

__all__ = ["device_memory_bytes", "host_memory_bytes", "mapped_zeros", "trim_host_memory"]


def host_memory_bytes() -> int:
    """This process's unique set size (memory freed if it exited), or its RSS where USS is
    not available."""
    process = psutil.Process()
    try:
        uss: int = process.memory_full_info().uss
        return uss
    except (psutil.AccessDenied, AttributeError):
        rss: int = process.memory_info().rss
        return rss


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    func = getattr(ctypes.CDLL(name), "malloc_trim", None)  # glibc only
    if func is None:
        return None
    func.argtypes = [ctypes.c_size_t]
    func.restype = ctypes.c_int
    trim: Callable[[int], int] = func
    return trim


def trim_host_memory() -> bool:
    """Return freed heap pages to the OS (glibc ``malloc_trim``); False where unavailable.

    glibc keeps freed blocks below its mmap threshold in its arenas, so a process's RSS does
    not shrink after tensors are freed until the arenas are trimmed.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def device_memory_bytes(device: torch.device) -> int:
    """Bytes the worker holds on ``device``: torch's allocated bytes on a GPU, else the
    process's host memory (see :func:`host_memory_bytes`)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return host_memory_bytes()


def mapped_zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in an anonymous mapping of its own, resident from the start.

    Freeing it unmaps it, so its memory goes back to the OS at once, whatever the state of
    the C allocator. A tensor from ``torch.zeros`` may not: after a large block is freed,
    glibc raises its mmap threshold and serves later large blocks from its arenas, and
    :func:`trim_host_memory` did not return such a block freed by a worker thread (measured:
    a 16 MB tensor allocated again after a free released nothing when freed). For buffers
    that :meth:`~executor_core.WorkerBase.sleep` must give back, such as a KV cache.
    """
    numel = math.prod(shape)
    if numel == 0:
        return torch.zeros(tuple(shape), dtype=dtype)
    buffer = mmap.mmap(-1, numel * dtype.itemsize)  # the tensor keeps it alive
    tensor = torch.frombuffer(buffer, dtype=dtype, count=numel).view(tuple(shape))
    return tensor.zero_()  # touch every page: the memory is held now, as with torch.zeros
