"""TensorOffloader: keeps tensors outside the worker's memory while it sleeps."""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import io
import itertools
import math
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Literal

import torch

from ._memory import release_pinned_host_memory

__all__ = ["TensorOffloader"]

# Pinned memory comes from torch's pinned allocator (emptied after each restore), not from
# cudaHostRegister through torch.cuda.cudart(): a failed registration leaves its error as the
# runtime's last error, which torch's next kernel launch check would raise, so a worker whose
# sleep failed could not run a step afterwards. torch also tracks the copies using a buffer.

#: The size of the host buffers that hold offloaded tensors. A power of two because torch's
#: pinned allocator rounds every request up to one (and pins all of it): one buffer per
#: tensor, or one for all, can pin almost twice the bytes offloaded. Large enough that pinning
#: one costs little next to copying it; bounded so that no request pins one huge range.
_BUFFER_BYTES = 1 << 28
#: Below one buffer, the rest goes in power-of-two buffers down to this size and one last
#: buffer for what is left under it: at most this many bytes are pinned beyond the tensors'.
_MIN_BUFFER_BYTES = 1 << 20

#: name -> (offset of its bytes in the file or in the host buffers, dtype, shape).
_Index = dict[str, tuple[int, torch.dtype, tuple[int, ...]]]


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (valid while the tensor lives)."""
    if tensor.nbytes == 0:
        return memoryview(bytearray())  # an empty tensor may have no storage address
    return memoryview((ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())).cast("B")


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a 1-D uint8 tensor on its device: a view when it is contiguous
    (as a fresh tensor is), else a contiguous copy."""
    return tensor.detach().contiguous().view(-1).view(torch.uint8)


def _write_all(file: io.FileIO, view: memoryview) -> None:
    """Write all of ``view``. One ``write`` may write less: Linux moves at most about 2 GiB
    per call, and a disk that fills part-way takes what fits before it fails."""
    done = 0
    while done < len(view):
        written = file.write(view[done:])
        if not written:
            raise OSError(f"the offload file took no more bytes after {done} of {len(view)}")
        done += written


def _buffer_sizes(total: int) -> list[int]:
    """The sizes of the host buffers that hold ``total`` bytes (see :data:`_BUFFER_BYTES`):
    full buffers, then the rest in decreasing powers of two down to
    :data:`_MIN_BUFFER_BYTES`, then what is left."""
    sizes: list[int] = []
    left = total
    while left > 0:
        size = min(_BUFFER_BYTES, 1 << (left.bit_length() - 1))  # a power of two <= left
        size = left if left <= _MIN_BUFFER_BYTES else size
        sizes.append(size)
        left -= size
    return sizes


def _pieces(start: int, length: int, sizes: Sequence[int]) -> Iterator[tuple[int, int, int, int]]:
    """Where bytes ``start .. start + length`` of the buffers' concatenation lie: ``(buffer,
    offset in it, offset in the range, bytes)`` for each buffer the range crosses."""
    starts = list(itertools.accumulate(sizes, initial=0))
    done = 0
    index = bisect.bisect_right(starts, start) - 1
    while done < length:
        offset = start + done - starts[index]
        count = min(length - done, sizes[index] - offset)
        yield index, offset, done, count
        done += count
        index += 1


class TensorOffloader:
    """Moves named tensors out of a worker's device memory and back.

    ``storage`` says where they go: ``"file"`` (the default on the CPU), an anonymous
    temporary file in ``directory``, unlinked on creation so that it goes with the process
    however that ends; or ``"host"`` (the default, and the only choice, on an accelerator),
    host memory, pinned on CUDA so that the copies run asynchronously. Pinned memory goes
    back to the OS as soon as :meth:`restore` has copied the tensors back.

    A failed :meth:`offload` (a pinned allocation refused, a full disk) holds nothing and
    leaves the caller's tensors untouched, to go on with and offload later; a failed
    :meth:`restore` (no device memory) keeps everything offloaded, so it can be retried.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        directory: str | None = None,
        storage: Literal["file", "host"] | None = None,
    ) -> None:
        if storage is None:
            storage = "file" if device.type == "cpu" else "host"
        if storage not in ("file", "host"):
            raise ValueError(f"storage must be 'file' or 'host', not {storage!r}")
        if storage == "file" and device.type != "cpu":
            raise ValueError(f"storage='file' holds CPU tensors only, not {device.type!r} ones")
        self.device = device
        #: Where offloaded tensors go: ``"file"`` or ``"host"`` (see the class).
        self.storage: Literal["file", "host"] = storage
        self._directory = directory
        # Pinned host memory makes the copies asynchronous; it exists where CUDA does.
        self._pinned = storage == "host" and device.type == "cuda"
        self._file: io.FileIO | None = None
        self._index: _Index = {}
        self._buffers: list[torch.Tensor] = []

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of the tensors held now."""
        return sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in self._index.values())

    @property
    def buffer_bytes(self) -> int:
        """Bytes of host memory that hold them now (pinned on CUDA): at least
        :attr:`offloaded_bytes`, as asked of the allocator; 0 with ``storage="file"``."""
        return sum(buffer.numel() for buffer in self._buffers)

    @property
    def holds_tensors(self) -> bool:
        """True between a successful :meth:`offload` and a successful :meth:`restore`."""
        return bool(self._index)

    def offload(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """Copy ``tensors`` out; return their bytes. The caller then drops its own copies.

        If it raises, nothing is held and ``tensors`` are as they were.
        """
        if self.holds_tensors:
            raise RuntimeError("tensors are already offloaded; restore them first")
        if self.storage == "file":
            self._offload_to_file(tensors)
        else:
            self._offload_to_host(tensors)
        return self.offloaded_bytes

    def restore(self) -> dict[str, torch.Tensor]:
        """The offloaded tensors, back on the device; the offloader then holds nothing (and,
        on CUDA, its pinned memory is back with the OS).

        If it raises, everything stays offloaded and a later call can restore it.
        """
        if not self._index:
            return {}
        if self.storage == "file":
            return self._restore_from_file()
        return self._restore_from_host()

    def close(self) -> None:
        """Drop everything held and close the file. Idempotent."""
        self._index = {}
        self._drop_buffers(self._buffers)
        file, self._file = self._file, None
        if file is not None:
            file.close()

    # --- file ---------------------------------------------------------------------------------

    def _offload_to_file(self, tensors: Mapping[str, torch.Tensor]) -> None:
        elsewhere = [name for name, t in tensors.items() if t.device.type != "cpu"]
        if elsewhere:
            raise ValueError(f"storage='file' holds CPU tensors only; not on the CPU: {elsewhere}")
        if self._file is None:
            # Kept open across sleeps (closed in close()); unlinked at once, so never leaked.
            self._file = tempfile.TemporaryFile(  # noqa: SIM115 - lives as long as the offloader
                buffering=0, prefix="executor-offload-", dir=self._directory
            )
        file = self._file
        index: _Index = {}
        try:
            file.seek(0)
            file.truncate()
            offset = 0
            for name, tensor in tensors.items():
                data = tensor.detach().contiguous()
                _write_all(file, _byte_view(data))
                index[name] = (offset, data.dtype, tuple(data.shape))
                offset += data.nbytes
        except BaseException:
            # Whatever the write left in the file (it may not even truncate now), closing it
            # gives its blocks back, since it has no name; the next offload opens a new one.
            self._file = None
            with contextlib.suppress(OSError):
                file.close()
            raise
        self._index = index

    def _restore_from_file(self) -> dict[str, torch.Tensor]:
        file = self._file
        assert file is not None  # set whenever the index is
        restored: dict[str, torch.Tensor] = {}
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
        self._index = {}
        file.truncate(0)
        return restored

    # --- host memory --------------------------------------------------------------------------

    def _wait_for_copies(self) -> None:
        """Wait for the copies queued between the device and the pinned buffers. They run on
        the current stream, behind the work that produced the tensors; the other copies
        (pageable memory) are done when they return."""
        if self._pinned:
            torch.cuda.current_stream(self.device).synchronize()

    def _drop_buffers(self, buffers: list[torch.Tensor]) -> None:
        """Drop the host ``buffers`` and give pinned memory back to the OS. The caller has
        waited for the copies that use them, or a failure came first: a buffer still in a copy
        would stay pinned in torch's cache."""
        if buffers:
            buffers.clear()  # the list is the only reference to each buffer: they are freed now
            if self._pinned:
                release_pinned_host_memory()

    def _offload_to_host(self, tensors: Mapping[str, torch.Tensor]) -> None:
        # The tensors' bytes end to end, in buffers of _buffer_sizes(): a tensor may straddle
        # two buffers, so it is copied in pieces.
        index: _Index = {}
        total = 0
        for name, tensor in tensors.items():
            index[name] = (total, tensor.dtype, tuple(tensor.shape))
            total += tensor.nbytes
        sizes = _buffer_sizes(total)
        buffers: list[torch.Tensor] = []
        try:
            # Every buffer before any copy: a refused allocation then finds nothing in flight.
            for size in sizes:
                buffers.append(torch.empty(size, dtype=torch.uint8, pin_memory=self._pinned))
            for name, tensor in tensors.items():
                source = _flat_bytes(tensor)
                for at, offset, done, count in _pieces(index[name][0], source.numel(), sizes):
                    buffers[at][offset : offset + count].copy_(
                        source[done : done + count], non_blocking=self._pinned
                    )
            self._wait_for_copies()
        except BaseException:
            # Roll back: nothing held, the caller's tensors untouched (they were only read).
            # Wait for the copies queued, so that their buffers can go back to the OS; if the
            # device cannot even do that, the original error is the one to report.
            with contextlib.suppress(Exception):
                self._wait_for_copies()
            self._drop_buffers(buffers)
            raise
        self._buffers, self._index = buffers, index

    def _restore_from_host(self) -> dict[str, torch.Tensor]:
        sizes = [buffer.numel() for buffer in self._buffers]
        restored: dict[str, torch.Tensor] = {}
        try:
            for name, (start, dtype, shape) in self._index.items():
                tensor = torch.empty(shape, dtype=dtype, device=self.device)
                target = _flat_bytes(tensor)  # a view: a fresh tensor is contiguous
                for at, offset, done, count in _pieces(start, target.numel(), sizes):
                    target[done : done + count].copy_(
                        self._buffers[at][offset : offset + count], non_blocking=self._pinned
                    )
                restored[name] = tensor
            # The copies read the buffers: they must be done before the buffers go.
            self._wait_for_copies()
        except BaseException:
            restored.clear()  # the buffers are kept: a later restore starts again
            raise
        self._index = {}
        self._drop_buffers(self._buffers)
        return restored
