"""What every side's workers do: nothing (``noop``), or return their argument's size.

Imported by every worker process, Ray actor and baseline reader, so it imports nothing heavy:
a tensor argument brings torch in through unpickling, not through this module.
"""

from __future__ import annotations

from typing import Any

from executor_core import WorkerBase

__all__ = ["BenchWorker", "answer", "size_of"]

#: The methods a side is called with.
NOOP = "noop"
SIZE_OF = "size_of"


#: A payload of this size or more is read, one byte of each page, before its size is returned.
_READ_FROM = 64 << 10
_PAGE = 4096


def size_of(payload: Any) -> int:
    """The size in bytes of a ``bytes`` payload or of a tensor's data, once one byte of each
    of its pages has been read (from 64 KiB), as any worker that uses its argument reads it: a
    transport that maps the argument lazily (into memory the worker has not touched yet) pays
    for that here, as it would in a real worker, and not after the row's clock stopped."""
    if isinstance(payload, bytes | bytearray | memoryview):
        if len(payload) >= _READ_FROM:
            sum(memoryview(payload).cast("B")[::_PAGE])
        return len(payload)
    nbytes = int(payload.numel() * payload.element_size())
    if nbytes >= _READ_FROM:
        import torch  # a tensor came: this process has torch loaded already

        payload.reshape(-1).view(torch.uint8)[::_PAGE].sum()
    return nbytes


def answer(method: str, args: tuple[Any, ...], rank: int = 0) -> Any:
    """What a baseline's reader of ``rank`` replies to ``method``: as :class:`BenchWorker`."""
    if method == SIZE_OF:
        return size_of(args[0])
    if method == NOOP:
        return None
    if method == "execute_model":
        return args[0]
    raise ValueError(f"unknown method {method!r}")


class BenchWorker(WorkerBase):
    """The worker every backend runs."""

    def noop(self) -> None:
        """Return at once: the call measures the backend's round trip alone."""
        return None

    def size_of(self, payload: Any) -> int:
        """Receive ``payload`` and return its size, so only the argument travels far."""
        return size_of(payload)

    def execute_model(self, batch: Any) -> Any:
        """Return ``batch``: a model step that costs nothing (the ``overhead`` workload)."""
        return batch
