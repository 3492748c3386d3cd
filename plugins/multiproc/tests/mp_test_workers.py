"""Workers used by the mp backend's tests (importable by qualname in worker processes)."""

from __future__ import annotations

import os
import time
from typing import Any

from executor_core import WorkerContext
from executor_core.testing import ConformanceWorker

#: When this module was imported in this process (a warm spare imports it ahead of a rank).
IMPORTED_AT = time.time()


class SlowStartWorker(ConformanceWorker):
    """Sleeps in ``init_device`` (to show that workers start in parallel)."""

    def __init__(self, *, context: WorkerContext, init_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(context=context, **kwargs)
        self.init_s = init_s

    def init_device(self) -> None:
        time.sleep(self.init_s)
        super().init_device()


class CodecWorker(ConformanceWorker):
    """Echoes what it received, to check what crosses the rings."""

    def identity(self, value: Any) -> Any:
        return value

    def keep(self, value: Any) -> None:
        """Hold on to an argument after the call (see ``kept``)."""
        self.__dict__.setdefault("_kept", []).append(value)

    def kept(self) -> list[Any]:
        return list(self.__dict__.get("_kept", []))

    def negate_on(self, tensor: Any, rank: int) -> float:
        """Negate the argument in place on ``rank``; every rank answers its argument's sum."""
        if self.rank == rank:
            tensor.neg_()
        return float(tensor.sum())

    def describe(self, value: Any) -> dict[str, Any]:
        return {"type": type(value).__name__, "rank": self.rank}

    def proc_name(self) -> str:
        with open(f"/proc/{os.getpid()}/comm") as comm:
            return comm.read().strip()

    def exit_now(self, code: int) -> None:
        os._exit(code)


class ImportTimeWorker(ConformanceWorker):
    """Says when its process imported this module."""

    def imported_at(self) -> float:
        return IMPORTED_AT
