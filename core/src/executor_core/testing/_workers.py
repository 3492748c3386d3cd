"""The worker the conformance suite drives. Importable by qualname in any worker process."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from .._worker import SLEEP_TAGS, WorkerBase, WorkerContext

__all__ = ["ConformanceWorker", "UnpicklableError"]


class UnpicklableError(Exception):
    """An exception that cannot cross a process boundary by pickle."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.handle = lambda: None  # lambdas do not pickle

    def __reduce__(self) -> Any:
        raise TypeError("UnpicklableError cannot be pickled")


class ConformanceWorker(WorkerBase):
    """A worker with small, observable methods for the conformance suite."""

    def __init__(
        self, *, context: WorkerContext, tag: str = "", fail_init_on_rank: int = -1
    ) -> None:
        super().__init__(context=context)
        self.tag = tag
        self.fail_init_on_rank = fail_init_on_rank
        self.recorded: list[Any] = []
        self.asleep: set[str] = set()
        self.sleep_level = 0
        self.healthy = True
        self.initialised = False
        self.loaded = False

    def init_device(self) -> None:
        if self.rank == self.fail_init_on_rank:
            raise RuntimeError(f"init_device failed on purpose on rank {self.rank}")
        self.initialised = True

    def load_model(self) -> None:
        self.loaded = True

    def get_rank(self) -> int:
        return self.rank

    def get_context(self) -> WorkerContext:
        return self.context

    def get_env(self, name: str) -> str | None:
        return os.environ.get(name)

    def get_pid(self) -> int:
        return os.getpid()

    def get_tag(self) -> str:
        return self.tag

    def is_ready(self) -> bool:
        return self.initialised and self.loaded

    def echo(self, *args: Any, **kwargs: Any) -> tuple[int, tuple[Any, ...], dict[str, Any]]:
        return self.rank, args, kwargs

    def slow(self, seconds: float, value: Any = None) -> tuple[int, Any]:
        time.sleep(seconds)
        return self.rank, value

    def fail(self, message: str, on_rank: int | None = None) -> int:
        if on_rank is None or on_rank == self.rank:
            raise ValueError(f"{message} (rank {self.rank})")
        return self.rank

    def fail_unpicklable(self, message: str) -> None:
        raise UnpicklableError(message)

    def record(self, item: Any) -> int:
        self.recorded.append(item)
        return len(self.recorded)

    def get_recorded(self) -> list[Any]:
        return list(self.recorded)

    def clear_recorded(self) -> None:
        self.recorded.clear()

    def payload_size(self, data: bytes) -> int:
        return len(data)

    def make_bytes(self, size: int, on_rank: int | None = None) -> bytes | None:
        if on_rank is not None and on_rank != self.rank:
            return None
        return bytes([self.rank % 256]) * size

    def execute_model(self, batch: Any) -> dict[str, Any]:
        return {"rank": self.rank, "batch": batch}

    def sleep(self, level: int = 1) -> None:
        self.asleep = set(SLEEP_TAGS)
        self.sleep_level = level

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self.asleep.difference_update(SLEEP_TAGS if tags is None else tags)

    def sleep_state(self) -> list[str]:
        return sorted(self.asleep)

    def set_healthy(self, healthy: bool, on_rank: int | None = None) -> None:
        if on_rank is None or on_rank == self.rank:
            self.healthy = healthy

    def check_health(self) -> None:
        if not self.healthy:
            raise RuntimeError(f"rank {self.rank} is unhealthy")
