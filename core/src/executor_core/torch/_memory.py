"""How much memory a worker holds: process USS/RSS on the host; on a GPU, the bytes torch's
allocator reserved and the device-wide bytes in use; torch's pinned host memory."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import psutil  # type: ignore[import-untyped]  # psutil ships no type information
import torch

__all__ = [
    "DeviceMemory",
    "device_memory",
    "host_memory_bytes",
    "mapped_zeros",
    "pinned_host_bytes",
    "release_pinned_host_memory",
    "trim_host_memory",
]


def host_memory_bytes() -> int:
    """This process's unique set size (memory freed if it exited), or its RSS where USS is
    not available."""
    process = psutil.Process()
    try:
        return int(process.memory_full_info().uss)
    except (psutil.AccessDenied, AttributeError):
        return int(process.memory_info().rss)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None  # glibc only
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]  # it returns an int, ctypes' default restype
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


@attrs.frozen(kw_only=True)
class DeviceMemory:
    """A device's memory as one process sees it (see :func:`device_memory`): what this
    process's torch holds (what sleep should bring down) and what the whole device has in use
    (what decides whether something else fits next to this worker)."""

    #: Bytes torch's caching allocator holds on the device for this process
    #: (``torch.cuda.memory_reserved``): live tensors plus its cache for reuse, not the CUDA
    #: context, NCCL's buffers or other libraries' allocations (those show in ``used_bytes``
    #: only). On the CPU: the process's memory (:func:`host_memory_bytes`).
    reserved_bytes: int
    #: Of ``reserved_bytes``, the bytes in live tensors (``torch.cuda.memory_allocated``). On
    #: the CPU, the same as ``reserved_bytes``.
    allocated_bytes: int
    #: Bytes in use on the whole device, by every process and the driver (total less free).
    #: On the CPU: the host's memory less what is available.
    used_bytes: int
    #: The device's memory (the host's on the CPU).
    total_bytes: int


def device_memory(device: torch.device) -> DeviceMemory:
    """This process's and the whole device's memory on ``device`` (see
    :class:`DeviceMemory`); on the CPU, the host's.

    On CUDA nothing is synchronised: allocations and frees are accounted for when they
    return, whatever kernels are still queued.
    """
    if device.type == "cpu":
        process = host_memory_bytes()
        host = psutil.virtual_memory()
        return DeviceMemory(
            reserved_bytes=process,
            allocated_bytes=process,
            used_bytes=int(host.total) - int(host.available),
            total_bytes=int(host.total),
        )
    # torch.cuda's calls, or for other accelerators torch's device-generic ones (if any).
    api: Any = torch.cuda if device.type == "cuda" else getattr(torch, "accelerator", None)
    where = device if device.type == "cuda" else device.index
    info_name = "mem_get_info" if device.type == "cuda" else "get_memory_info"
    reserved, allocated, info = (
        getattr(api, name, None) for name in ("memory_reserved", "memory_allocated", info_name)
    )
    if reserved is None or allocated is None or info is None:
        raise ValueError(
            f"cannot measure the memory of {device.type!r} devices with torch {torch.__version__}"
        )
    free, total = info(where)
    return DeviceMemory(
        reserved_bytes=int(reserved(where)),
        allocated_bytes=int(allocated(where)),
        used_bytes=int(total) - int(free),
        total_bytes=int(total),
    )


def _cuda_initialized() -> bool:
    """Whether this process has initialised CUDA (asking does not initialise it)."""
    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]  # unannotated


def pinned_host_bytes() -> int | None:
    """Bytes of pinned (page-locked) host memory that torch's pinned allocator holds, in use
    or cached for reuse (``torch.cuda.host_memory_stats``). 0 while CUDA is not initialised
    (nothing can be pinned then); ``None`` where this torch does not report it.

    Pinned pages cannot be swapped out or given to another process; a cached block stays
    pinned until :func:`release_pinned_host_memory`.
    """
    if not _cuda_initialized():
        return 0
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return None
    figures = stats()
    # The name of that figure changed: torch releases that also report the bytes in use
    # call it reserved_bytes (their allocated_bytes leaves the cache out); later ones call
    # it allocated_bytes (and the bytes in use active_bytes).
    value = figures.get("reserved_bytes.current", figures.get("allocated_bytes.current"))
    return None if value is None else int(value)


def release_pinned_host_memory() -> bool:
    """Give the pinned host memory that torch's pinned allocator caches, and no tensor uses,
    back to the OS. False where there was nothing to do (CUDA not initialised) or this torch
    cannot.

    torch keeps a freed pinned block for reuse, so pinned memory a process once used stays
    pinned (and resident) until this is called. It empties the whole process's cache: a
    block another part of the process freed goes too, and is pinned again when next needed.
    A block that a copy in flight still uses is not freed (it stays cached): synchronise
    the copies' stream first.
    """
    if not _cuda_initialized():
        return False
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    empty = empty or getattr(torch._C, "_host_emptyCache", None)  # before torch 2.12, private
    if empty is None:
        return False
    empty()
    return True


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
