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


def size_of(payload: Any) -> int:
    """The size in bytes of a ``bytes`` payload or of a tensor's data."""
    if isinstance(payload, bytes | bytearray | memoryview):
        return len(payload)
    return int(payload.numel() * payload.element_size())


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
