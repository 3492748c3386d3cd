"""The worker the conformance kit drives. Importable by qualname in any worker process."""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from executor_core import SLEEP_TAGS, WorkerBase, WorkerContext

from ._guard import process_identity

__all__ = ["ConformanceWorker", "UnpicklableError"]


class UnpicklableError(Exception):
    """An exception that cannot cross a process boundary by pickle."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.handle = lambda: None  # lambdas do not pickle

    def __reduce__(self) -> Any:
        raise TypeError("UnpicklableError cannot be pickled")


def _called_by_the_wrapper() -> bool:
    """True if the caller of our caller is ``WorkerWrapper.shutdown`` (which runs the
    ``executor_worker_stopping`` hook just before it calls the worker's ``shutdown``)."""
    from executor_core.backend import WorkerWrapper

    return sys._getframe(2).f_code is WorkerWrapper.shutdown.__code__


class ConformanceWorker(WorkerBase):
    """A worker with small, observable methods for the conformance kit.

    ``marker_dir``: where :meth:`shutdown` leaves ``shutdown-<rank>`` (``wrapper`` in it when
    the core's wrapper called it, so the stopping hook ran too) and :meth:`load_model`
    ``load-<rank>-<pid>``. ``load_s``: seconds :meth:`load_model` takes. ``preload``: modules
    it imports (so that a watched call does not). ``gloo``: :meth:`init_device` joins a gloo
    group at the context's rendezvous, as a real model's workers do.
    """

    def __init__(
        self,
        *,
        context: WorkerContext,
        tag: str = "",
        fail_init_on_rank: int = -1,
        marker_dir: str = "",
        load_s: float = 0.0,
        preload: tuple[str, ...] = (),
        gloo: bool = False,
    ) -> None:
        super().__init__(context=context)
        self.tag, self.fail_init_on_rank, self.marker_dir = tag, fail_init_on_rank, marker_dir
        self.load_s, self.preload, self.gloo = load_s, preload, gloo
        self.group: Any = None
        self.recorded: list[Any] = []
        self.asleep: set[str] = set()
        self.sleep_level = 0
        self.healthy = True
        self.initialised = self.loaded = False

    def init_device(self) -> None:
        """Fail on purpose on ``fail_init_on_rank``; otherwise mark the device ready."""
        if self.rank == self.fail_init_on_rank:
            raise RuntimeError(f"init_device failed on purpose on rank {self.rank}")
        if self.gloo:
            from executor_core.torch import init_distributed

            self.group = init_distributed(self.context, timeout_s=120)
        self.initialised = True

    def load_model(self) -> None:
        """Mark the model loaded (see the class docstring)."""
        if self.marker_dir:
            Path(self.marker_dir, f"load-{self.rank}-{os.getpid()}").touch()
        time.sleep(self.load_s)
        for module in self.preload:
            importlib.import_module(module)
        self.loaded = True

    def get_rank(self) -> int:
        """This worker's rank."""
        return self.rank

    def rank_in_reverse(self, step_s: float) -> int:
        """This worker's rank, after ``(world_size - 1 - rank) * step_s``: the highest rank
        answers first (replies labelled by their order of arrival show)."""
        time.sleep((self.world_size - 1 - self.rank) * step_s)
        return self.rank

    def get_context(self) -> WorkerContext:
        """This worker's WorkerContext."""
        return self.context

    def get_env(self, name: str) -> str | None:
        """An environment variable as this worker's process sees it."""
        return os.environ.get(name)

    def get_pid(self) -> int:
        """The pid of the process hosting this worker."""
        return os.getpid()

    def get_process(self) -> tuple[int, str]:
        """This process: its pid, and its ``process_identity`` (machine, namespace, start)."""
        return os.getpid(), process_identity()

    def get_tag(self) -> str:
        """The ``tag`` worker kwarg."""
        return self.tag

    def is_ready(self) -> bool:
        """True once init_device and load_model have run."""
        return self.initialised and self.loaded

    def echo(self, *args: Any, **kwargs: Any) -> tuple[int, tuple[Any, ...], dict[str, Any]]:
        """Return the rank with the arguments received."""
        return self.rank, args, kwargs

    def slow(self, seconds: float, value: Any = None) -> tuple[int, Any]:
        """Sleep ``seconds``, then return the rank and ``value``."""
        time.sleep(seconds)
        return self.rank, value

    def hold(self, release: str, on_rank: int, max_s: float) -> int:
        """On ``on_rank``, wait until the file ``release`` exists (at most ``max_s``): a rank
        hung in a call until the kit lets it go. Return the rank."""
        deadline = time.monotonic() + max_s
        while self.rank == on_rank and not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.rank

    def fail(self, message: str, on_rank: int | None = None) -> int:
        """Raise ValueError (on every rank, or only on ``on_rank``)."""
        if on_rank is None or on_rank == self.rank:
            raise ValueError(f"{message} (rank {self.rank})")
        return self.rank

    def fail_later_on_lower_ranks(self, delay_s: float) -> None:
        """Raise on every rank, rank r after ``(world_size - 1 - r) * delay_s``."""
        time.sleep((self.world_size - 1 - self.rank) * delay_s)
        raise ValueError(f"failed on rank {self.rank}")

    def fail_unpicklable(self, message: str) -> None:
        """Raise an exception that cannot be pickled."""
        raise UnpicklableError(message)

    def record(self, item: Any) -> int:
        """Append ``item`` to this worker's record; return the record's length."""
        self.recorded.append(item)
        return len(self.recorded)

    def record_slowly(self, item: Any, seconds: float) -> int:
        """:meth:`record` ``item``, then sleep ``seconds``."""
        length = self.record(item)
        time.sleep(seconds)
        return length

    def get_recorded(self) -> list[Any]:
        """What :meth:`record` has seen, in order."""
        return list(self.recorded)

    def clear_recorded(self) -> None:
        """Empty the record."""
        self.recorded.clear()

    def payload_size(self, data: bytes) -> int:
        """The length of ``data`` (checks large arguments arrive whole)."""
        return len(data)

    def make_bytes(self, size: int, on_rank: int | None = None) -> bytes | None:
        """``size`` bytes of this rank's number (``None`` on ranks other than ``on_rank``)."""
        if on_rank is not None and on_rank != self.rank:
            return None
        return bytes([self.rank % 256]) * size

    def execute_model(self, batch: Any) -> dict[str, Any]:
        """Return the rank and the batch."""
        return {"rank": self.rank, "batch": batch}

    def sleep(self, level: int = 1) -> None:
        """Mark every sleep tag asleep."""
        self.asleep = set(SLEEP_TAGS)
        self.sleep_level = level

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Wake ``tags`` (all when ``None``)."""
        self.asleep.difference_update(SLEEP_TAGS if tags is None else tags)

    def sleep_state(self) -> list[str]:
        """The tags asleep, sorted."""
        return sorted(self.asleep)

    def set_healthy(self, healthy: bool, on_rank: int | None = None) -> None:
        """Set health (on every rank, or only on ``on_rank``)."""
        if on_rank is None or on_rank == self.rank:
            self.healthy = healthy

    def check_health(self) -> None:
        """Raise RuntimeError while unhealthy."""
        if not self.healthy:
            raise RuntimeError(f"rank {self.rank} is unhealthy")

    def shutdown(self) -> None:
        """Leave ``shutdown-<rank>`` in ``marker_dir`` (saying whether the wrapper called)."""
        if self.marker_dir:
            text = "wrapper" if _called_by_the_wrapper() else "direct"
            Path(self.marker_dir, f"shutdown-{self.rank}").write_text(text)
