"""TensorOffloader: keeps tensors outside the worker's memory while it sleeps."""

from __future__ import annotations

import ctypes
import io
import tempfile
from collections.abc import Mapping

import torch

__all__ = ["TensorOffloader"]


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (valid while the tensor lives)."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


class TensorOffloader:
    """Moves named tensors out of a worker's device memory and back.

    On a GPU the tensors go to pinned host memory (fast copies back). On the CPU they go to
    an anonymous temporary file, outside the process's resident memory: the file is unlinked
    on creation, so it disappears with the process however that ends.
    """

    def __init__(self, device: torch.device, *, directory: str | None = None) -> None:
        self.device = device
        self._directory = directory
        self._file: io.FileIO | None = None
        self._index: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
        self._host: dict[str, torch.Tensor] = {}

    @property
    def offloaded_bytes(self) -> int:
        """Bytes held by the offloader now."""
        on_file = sum(_nbytes(dtype, shape) for _offset, dtype, shape in self._index.values())
        return on_file + sum(t.numel() * t.element_size() for t in self._host.values())

    @property
    def holds_tensors(self) -> bool:
        """True between :meth:`offload` and :meth:`restore`."""
        return bool(self._index or self._host)

    def offload(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """Copy ``tensors`` out; return their bytes. The caller then drops its own copies."""
        if self.holds_tensors:
            raise RuntimeError("tensors are already offloaded; restore them first")
        if self.device.type == "cpu":
            self._offload_to_file(tensors)
        else:
            pin = self.device.type == "cuda"
            for name, tensor in tensors.items():
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
                host.copy_(tensor, non_blocking=pin)
                self._host[name] = host
            if pin:
                torch.cuda.synchronize(self.device)
        return self.offloaded_bytes

    def _offload_to_file(self, tensors: Mapping[str, torch.Tensor]) -> None:
        if self._file is None:
            # Kept open across sleeps (closed in close()); unlinked at once, so never leaked.
            self._file = tempfile.TemporaryFile(  # noqa: SIM115 - lives as long as the offloader
                buffering=0, prefix="executor-offload-", dir=self._directory
            )
        file = self._file
        file.seek(0)
        file.truncate()
        offset = 0
        for name, tensor in tensors.items():
            data = tensor.detach().contiguous()
            file.write(_byte_view(data))
            self._index[name] = (offset, data.dtype, tuple(data.shape))
            offset += data.numel() * data.element_size()
        file.flush()

    def restore(self) -> dict[str, torch.Tensor]:
        """The offloaded tensors, back on the device; the offloader then holds nothing."""
        restored: dict[str, torch.Tensor] = {}
        if self._index:
            file = self._file
            assert file is not None  # set whenever the index is
            for name, (offset, dtype, shape) in self._index.items():
                tensor = torch.empty(shape, dtype=dtype)
                view = _byte_view(tensor)
                file.seek(offset)
                got = 0
                while got < len(view):
                    n = file.readinto(view[got:])
                    if not n:
                        raise RuntimeError(f"offload file ended early while restoring {name!r}")
                    got += n
                restored[name] = tensor
            self._index.clear()
            file.truncate(0)
        if self._host:
            non_blocking = self.device.type == "cuda"
            for name, host in self._host.items():
                restored[name] = host.to(self.device, non_blocking=non_blocking)
            if non_blocking:
                torch.cuda.synchronize(self.device)
            self._host.clear()
        return restored

    def close(self) -> None:
        """Drop everything held and close the file. Idempotent."""
        self._index.clear()
        self._host.clear()
        file, self._file = self._file, None
        if file is not None:
            file.close()


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * dtype.itemsize
