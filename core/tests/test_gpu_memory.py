"""Memory on a GPU and the offloader: what is measured, when pinned host memory goes back
to the OS, and that a failed offload or restore rolls back.

This suite runs without a GPU, so CUDA is stood in for (:class:`FakeCuda`): pinned buffers
are host buffers whose release a test can see, device tensors live on the CPU, and the
stream and the pinned cache record what was asked of them. The CPU paths run for real.
"""

from __future__ import annotations

import array
import errno
import io
import math
import os
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from executor_core.torch import (
    DeviceMemory,
    TensorOffloader,
    _offload,
    device_memory,
    host_memory_bytes,
    pinned_host_bytes,
    release_pinned_host_memory,
)

CUDA = torch.device("cuda", 1)


class FakeStream:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda

    def synchronize(self) -> None:
        self.cuda.events.append("sync")
        if self.cuda.fail_sync:
            self.cuda.fail_sync = False
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


class FakeCuda:
    """What the offloader asks of CUDA, on the CPU.

    ``torch.empty(..., pin_memory=True)`` returns a tensor over an ``array`` this fake keeps
    a weak reference to (so :meth:`live_pinned` tells how many pinned buffers still exist),
    ``torch.empty(..., device=cuda)`` a CPU tensor; the current stream and the pinned cache
    record their calls in :attr:`events`. ``fail_pinned_at`` / ``fail_device_at`` make that
    pinned or device allocation (counted from 0) fail; ``fail_sync`` the next synchronize.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[str] = []
        self.pinned_sizes: list[int] = []
        self._pinned: list[weakref.ref[array.array[int]]] = []
        self.device_allocations = 0
        self.fail_pinned_at: int | None = None
        self.fail_device_at: int | None = None
        self.fail_sync = False
        #: How many pinned buffers were alive at each call that empties the pinned cache.
        self.live_at_empty: list[int] = []
        real_empty = torch.empty

        def empty(*size: Any, **kwargs: Any) -> torch.Tensor:
            if len(size) == 1 and isinstance(size[0], tuple | list | torch.Size):
                size = tuple(size[0])
            if kwargs.pop("pin_memory", False):
                assert kwargs.pop("dtype") is torch.uint8  # the offloader pins byte buffers
                assert not kwargs
                return self._pin(math.prod(size))
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cuda":
                assert torch.device(device) == CUDA
                count = self.device_allocations
                self.device_allocations += 1
                if count == self.fail_device_at:
                    raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
                kwargs["device"] = "cpu"
            return real_empty(size, **kwargs)

        monkeypatch.setattr(torch, "empty", empty)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_stream", self.current_stream)
        monkeypatch.setattr(torch.accelerator, "empty_host_cache", self.empty_host_cache)

    def _pin(self, nbytes: int) -> torch.Tensor:
        count = len(self.pinned_sizes)
        self.pinned_sizes.append(nbytes)
        if count == self.fail_pinned_at:
            raise RuntimeError("CUDA error: out of memory (stand-in for cudaHostAlloc)")
        store = array.array("B", bytes(nbytes))
        self._pinned.append(weakref.ref(store))
        self.events.append("pin")
        return torch.frombuffer(store, dtype=torch.uint8)

    def live_pinned(self) -> int:
        return sum(ref() is not None for ref in self._pinned)

    def current_stream(self, device: torch.device | None = None) -> FakeStream:
        assert device == CUDA, device
        return FakeStream(self)

    def empty_host_cache(self) -> None:
        self.events.append("empty_host_cache")
        self.live_at_empty.append(self.live_pinned())


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    return FakeCuda(monkeypatch)


@pytest.fixture
def small_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Buffers of 4 KiB (tail pieces down to 256 B), so that small tensors straddle them."""
    monkeypatch.setattr(_offload, "_BUFFER_BYTES", 1 << 12)
    monkeypatch.setattr(_offload, "_MIN_BUFFER_BYTES", 1 << 8)


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(50, 30, generator=generator),  # 6000 bytes: crosses a 4 KiB buffer
        "ids": torch.arange(10, dtype=torch.int64),
        "half": torch.randn(17, 9, generator=generator).to(torch.bfloat16),
        "mask": torch.rand(33, generator=generator) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "big": torch.randn(3000, generator=generator),  # 12000 bytes: spans several buffers
    }


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def _pinned_by_torch(size: int) -> int:
    """What torch's pinned allocator pins for a request of ``size`` bytes."""
    return 1 << (size - 1).bit_length()


# --- measuring ---------------------------------------------------------------------------------


def test_cuda_memory_is_the_allocators_reserved_bytes_and_the_devices_used_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[tuple[str, torch.device]] = []

    def figure(name: str, value: Any) -> Any:
        def call(device: torch.device) -> Any:
            asked.append((name, device))
            return value

        return call

    monkeypatch.setattr(torch.cuda, "mem_get_info", figure("mem_get_info", (300, 1000)))
    monkeypatch.setattr(torch.cuda, "memory_reserved", figure("memory_reserved", 500))
    monkeypatch.setattr(torch.cuda, "memory_allocated", figure("memory_allocated", 200))
    memory = device_memory(CUDA)
    assert memory == DeviceMemory(
        reserved_bytes=500, allocated_bytes=200, used_bytes=700, total_bytes=1000
    )
    assert {device for _name, device in asked} == {CUDA}


def test_cpu_memory_is_the_process_and_the_host() -> None:
    memory = device_memory(torch.device("cpu"))
    assert memory.reserved_bytes == memory.allocated_bytes
    assert 0 < memory.reserved_bytes <= memory.used_bytes <= memory.total_bytes
    assert memory.reserved_bytes == pytest.approx(host_memory_bytes(), rel=0.2)


def test_pinned_host_bytes_come_from_torchs_pinned_allocator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert pinned_host_bytes() == 0  # nothing can be pinned before CUDA starts
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    stats = {"allocated_bytes.current": 4096, "active_bytes.current": 1024}
    monkeypatch.setattr(torch.cuda, "host_memory_stats", lambda: stats)
    assert pinned_host_bytes() == 4096  # in use and cached: all of it is pinned
    # Earlier torch: allocated_bytes is what is in use, reserved_bytes all of it.
    stats = {"allocated_bytes.current": 1024, "reserved_bytes.current": 8192}
    assert pinned_host_bytes() == 8192
    monkeypatch.setattr(torch.cuda, "host_memory_stats", dict)
    assert pinned_host_bytes() is None
    monkeypatch.delattr(torch.cuda, "host_memory_stats")
    assert pinned_host_bytes() is None


def test_release_pinned_host_memory_empties_torchs_pinned_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: calls.append("public"))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert release_pinned_host_memory() is False  # no CUDA: nothing pinned, nothing done
    assert calls == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert release_pinned_host_memory() is True
    assert calls == ["public"]
    # torch without the public call: the private one it wraps.
    monkeypatch.delattr(torch.accelerator, "empty_host_cache")
    monkeypatch.setattr(
        torch._C, "_host_emptyCache", lambda: calls.append("private"), raising=False
    )
    assert release_pinned_host_memory() is True
    assert calls == ["public", "private"]
    monkeypatch.delattr(torch._C, "_host_emptyCache")
    assert release_pinned_host_memory() is False


# --- the pinned buffers' sizes -----------------------------------------------------------------


@pytest.mark.parametrize(
    "total",
    [0, 1, 255, 1 << 20, (1 << 20) + 1, 3 << 20, (1 << 28) - 1, 1 << 28, (5 << 28) + 12345],
)
def test_pinned_buffers_waste_less_than_the_smallest_buffer(total: int) -> None:
    sizes = _offload._buffer_sizes(total)
    assert sum(sizes) == total
    full = total // _offload._BUFFER_BYTES
    assert sizes[:full] == [_offload._BUFFER_BYTES] * full
    assert all(s & (s - 1) == 0 for s in sizes[:-1])  # powers of two: pinned as asked
    pinned = sum(_pinned_by_torch(s) for s in sizes)
    assert pinned - total < _offload._MIN_BUFFER_BYTES
    assert len(sizes) <= full + 9  # the tail: powers of two from 128 MiB to 1 MiB, then one


# --- offloading to pinned memory (CUDA stood in for) -------------------------------------------


@pytest.mark.usefixtures("small_buffers")
def test_weights_go_to_pinned_buffers_and_the_memory_goes_back_after_restore(
    cuda: FakeCuda,
) -> None:
    tensors = _tensors()
    expected = {k: v.clone() for k, v in tensors.items()}
    offloader = TensorOffloader(CUDA)
    assert offloader.storage == "host"
    total = _nbytes(tensors)
    assert offloader.offload(tensors) == total
    assert offloader.holds_tensors
    assert offloader.offloaded_bytes == total
    # Pinned, in power-of-two buffers but the last (small) one, and little beyond the bytes.
    assert sum(cuda.pinned_sizes) == offloader.buffer_bytes == total
    assert all(s & (s - 1) == 0 for s in cuda.pinned_sizes[:-1])
    assert sum(_pinned_by_torch(s) for s in cuda.pinned_sizes) - total < 1 << 8
    assert cuda.live_pinned() == len(cuda.pinned_sizes) > 2
    # The asynchronous copies were waited for before offload returned.
    assert cuda.events == ["pin"] * len(cuda.pinned_sizes) + ["sync"]
    for tensor in tensors.values():
        tensor.zero_()  # what the device held is gone: restore must bring it from the buffers
    cuda.events.clear()
    restored = offloader.restore()
    _assert_same(restored, expected)
    assert cuda.device_allocations == len(expected)  # each tensor allocated on the device
    # The copies back finished, then every pinned buffer was freed, then torch's pinned
    # cache was emptied: the pinned memory is with the OS, not cached for reuse.
    assert cuda.events == ["sync", "empty_host_cache"]
    assert cuda.live_at_empty == [0]
    assert cuda.live_pinned() == 0
    assert not offloader.holds_tensors
    assert offloader.offloaded_bytes == offloader.buffer_bytes == 0
    assert offloader.restore() == {}


@pytest.mark.usefixtures("small_buffers")
def test_a_refused_pinned_allocation_part_way_rolls_back(cuda: FakeCuda) -> None:
    tensors = _tensors()
    expected = {k: v.clone() for k, v in tensors.items()}
    pointers = {k: v.data_ptr() for k, v in tensors.items()}
    offloader = TensorOffloader(CUDA)
    cuda.fail_pinned_at = 2
    with pytest.raises(RuntimeError, match="out of memory"):
        offloader.offload(tensors)
    # Nothing held: the two buffers pinned before the failure were freed and handed back to
    # the OS (torch would otherwise keep them pinned in its cache).
    assert not offloader.holds_tensors
    assert offloader.offloaded_bytes == offloader.buffer_bytes == 0
    assert cuda.live_pinned() == 0
    assert cuda.events == ["pin", "pin", "sync", "empty_host_cache"]
    assert cuda.live_at_empty == [0]
    # The caller's tensors are as they were, where they were.
    _assert_same(tensors, expected)
    assert {k: v.data_ptr() for k, v in tensors.items()} == pointers
    # The offloader is usable again: the next sleep works.
    cuda.fail_pinned_at = None
    assert offloader.offload(tensors) == _nbytes(expected)
    _assert_same(offloader.restore(), expected)
    assert cuda.live_pinned() == 0


@pytest.mark.usefixtures("small_buffers")
def test_a_copy_that_fails_on_the_device_rolls_back(cuda: FakeCuda) -> None:
    tensors = _tensors()
    expected = {k: v.clone() for k, v in tensors.items()}
    offloader = TensorOffloader(CUDA)
    cuda.fail_sync = True  # an asynchronous copy's error shows when the stream is waited for
    with pytest.raises(RuntimeError, match="illegal memory access"):
        offloader.offload(tensors)
    assert not offloader.holds_tensors
    assert cuda.live_pinned() == 0
    assert cuda.events[-1] == "empty_host_cache"
    assert cuda.live_at_empty == [0]
    _assert_same(tensors, expected)
    assert offloader.offload(tensors) == _nbytes(expected)
    _assert_same(offloader.restore(), expected)


@pytest.mark.usefixtures("small_buffers")
def test_a_failed_restore_keeps_everything_offloaded(cuda: FakeCuda) -> None:
    tensors = _tensors()
    expected = {k: v.clone() for k, v in tensors.items()}
    offloader = TensorOffloader(CUDA)
    offloader.offload(tensors)
    pinned = cuda.live_pinned()
    cuda.fail_device_at = 1  # no device memory for the second tensor
    with pytest.raises(torch.OutOfMemoryError):
        offloader.restore()
    assert offloader.holds_tensors
    assert offloader.offloaded_bytes == _nbytes(expected)
    assert cuda.live_pinned() == pinned
    assert "empty_host_cache" not in cuda.events
    _assert_same(offloader.restore(), expected)  # the wake can be retried
    assert cuda.live_pinned() == 0


def test_close_gives_pinned_memory_back(cuda: FakeCuda) -> None:
    offloader = TensorOffloader(CUDA)
    offloader.offload(_tensors())
    assert cuda.live_pinned() > 0
    offloader.close()
    assert cuda.live_pinned() == 0
    assert cuda.live_at_empty == [0]
    assert not offloader.holds_tensors
    offloader.close()


def test_storage_choices() -> None:
    assert TensorOffloader(torch.device("cpu")).storage == "file"
    assert TensorOffloader(CUDA).storage == "host"
    with pytest.raises(ValueError, match="CPU tensors only"):
        TensorOffloader(CUDA, storage="file")
    with pytest.raises(ValueError, match="storage must be"):
        TensorOffloader(torch.device("cpu"), storage="disk")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not on the CPU"):
        TensorOffloader(torch.device("cpu")).offload({"x": torch.empty(2, device="meta")})


# --- the CPU, for real -------------------------------------------------------------------------


@pytest.mark.usefixtures("small_buffers")
def test_host_storage_round_trips_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    released: list[bool] = []
    monkeypatch.setattr(_offload, "release_pinned_host_memory", lambda: released.append(True))
    tensors = _tensors()
    expected = {k: v.clone() for k, v in tensors.items()}
    offloader = TensorOffloader(torch.device("cpu"), storage="host")
    assert offloader.offload(tensors) == _nbytes(expected)
    assert offloader.buffer_bytes == _nbytes(expected)
    for tensor in tensors.values():
        tensor.zero_()
    _assert_same(offloader.restore(), expected)
    assert offloader.buffer_bytes == 0
    assert released == []  # nothing was pinned: no cache to empty


def test_a_failed_file_write_part_way_rolls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = _tensors()
    expected = {k: v.clone() for k, v in tensors.items()}
    offloader = TensorOffloader(torch.device("cpu"), directory=str(tmp_path))
    write_all = _offload._write_all
    files: list[io.FileIO] = []

    def disk_fills_on_the_third_tensor(file: io.FileIO, view: memoryview) -> None:
        files.append(file)
        if len(files) == 3:
            file.write(view[: len(view) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write_all(file, view)

    monkeypatch.setattr(_offload, "_write_all", disk_fills_on_the_third_tensor)
    with pytest.raises(OSError, match="No space left"):
        offloader.offload(tensors)
    assert not offloader.holds_tensors
    assert offloader.offloaded_bytes == 0
    assert files[0].closed  # the half-written file is gone (it had no name), space and all
    _assert_same(tensors, expected)
    monkeypatch.undo()
    assert offloader.offload(tensors) == _nbytes(expected)
    for tensor in tensors.values():
        tensor.zero_()
    _assert_same(offloader.restore(), expected)
    assert os.listdir(tmp_path) == []
    offloader.close()


_FULL_DISK_SCRIPT = """
import errno, resource, signal, sys
import torch
from executor_core.torch import TensorOffloader

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
tensors = {"a": torch.randn(2**18), "b": torch.randn(2**18)}  # 1 MiB each
expected = {k: v.clone() for k, v in tensors.items()}
offloader = TensorOffloader(torch.device("cpu"), directory=sys.argv[1])
# Files may not grow past 1.5 MiB: "b" is written in part (a short write), then refused.
resource.setrlimit(resource.RLIMIT_FSIZE, (3 * 2**19, hard))
try:
    offloader.offload(tensors)
except OSError as error:
    code = errno.errorcode[error.errno]
else:
    raise SystemExit("the offload did not fail")
finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
assert not offloader.holds_tensors and offloader.offloaded_bytes == 0
assert all(torch.equal(tensors[k], expected[k]) for k in tensors)
assert offloader.offload(tensors) == 2 * 2**20
restored = offloader.restore()
assert all(torch.equal(restored[k], expected[k]) for k in tensors)
print(code)
"""


def test_a_full_disk_part_way_rolls_back(tmp_path: Path) -> None:
    """A real failure, in a process of its own: a file-size limit stops the write part-way."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_FULL_DISK_SCRIPT), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["EFBIG"]
