"""The workers the conformance kit drives (importable by qualname in any worker process):
:class:`ConformanceWorker`, and :class:`DeviceProbeWorker`, which stands in for
``torch.cuda``'s per-thread current device (no GPU here) and reports what each call sees."""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from executor_core import SLEEP_TAGS, WorkerBase, WorkerContext

from ._guard import process_identity


class UnpicklableError(Exception):
    """An exception that cannot cross a process boundary by pickle."""

    def __reduce__(self) -> Any:
        raise TypeError("UnpicklableError cannot be pickled")


class ConformanceWorker(WorkerBase):
    """A worker with small, observable methods for the conformance kit: ``get_rank``,
    ``get_context``, ``get_env``, ``get_pid``, ``get_tag`` and ``is_ready`` return what they
    name, ``echo`` the rank with its arguments, ``payload_size`` the length of its bytes,
    ``execute_model`` the rank with the batch; ``sleep``, ``wake_up`` and ``sleep_state`` keep
    sleep tags, ``set_healthy`` the health that ``check_health`` reports.

    ``marker_dir``: where :meth:`shutdown` and :meth:`load_model` leave markers. ``load_s``:
    seconds :meth:`load_model` takes; ``preload``: modules it imports. ``gloo``:
    :meth:`init_device` joins a gloo group at the context's rendezvous, as a model's does.
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
        self.recorded: list[Any] = []
        self.asleep: set[str] = set()
        self.healthy, self.initialised, self.loaded = True, False, False

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
        return self.rank

    def rank_in_reverse(self, step_s: float) -> int:
        """This worker's rank, after ``(world_size - 1 - rank) * step_s``."""
        time.sleep((self.world_size - 1 - self.rank) * step_s)
        return self.rank

    def get_context(self) -> WorkerContext:
        return self.context

    def get_env(self, name: str) -> str | None:
        return os.environ.get(name)

    def get_pid(self) -> int:
        return os.getpid()

    def get_process(self) -> tuple[int, str]:
        """This process's pid and ``process_identity`` (machine, pid namespace, start)."""
        return os.getpid(), process_identity()

    def get_tag(self) -> str:
        return self.tag

    def is_ready(self) -> bool:
        return self.initialised and self.loaded

    def echo(self, *args: Any, **kwargs: Any) -> tuple[int, tuple[Any, ...], dict[str, Any]]:
        return self.rank, args, kwargs

    def slow(self, seconds: float, value: Any = None) -> tuple[int, Any]:
        """Sleep ``seconds``, then return the rank and ``value``."""
        time.sleep(seconds)
        return self.rank, value

    def hold(self, release: str, on_rank: int, max_s: float) -> int:
        """On ``on_rank``, wait until the file ``release`` exists (at most ``max_s``)."""
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

    def record(self, item: Any, seconds: float = 0.0) -> int:
        """Append ``item`` to the record, sleep ``seconds``; return the record's length."""
        self.recorded.append(item)
        time.sleep(seconds)
        return len(self.recorded)

    def get_recorded(self, clear: bool = False) -> list[Any]:
        """What :meth:`record` has seen, in order (and forget it, with ``clear``)."""
        recorded, self.recorded = self.recorded, [] if clear else list(self.recorded)
        return recorded

    def payload_size(self, data: bytes) -> int:
        return len(data)

    def make_bytes(self, size: int, on_rank: int | None = None) -> bytes | None:
        """``size`` bytes of this rank's number (``None`` on ranks other than ``on_rank``)."""
        return None if on_rank not in (None, self.rank) else bytes([self.rank % 256]) * size

    def execute_model(self, batch: Any) -> dict[str, Any]:
        return {"rank": self.rank, "batch": batch}

    def sleep(self, level: int = 1) -> None:
        self.asleep = set(SLEEP_TAGS)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self.asleep.difference_update(SLEEP_TAGS if tags is None else tags)

    def sleep_state(self) -> list[str]:
        return sorted(self.asleep)

    def set_healthy(self, healthy: bool, on_rank: int | None = None) -> None:
        if on_rank in (None, self.rank):
            self.healthy = healthy

    def check_health(self) -> None:
        if not self.healthy:
            raise RuntimeError(f"rank {self.rank} is unhealthy")

    def shutdown(self) -> None:
        """Leave ``shutdown-<rank>`` in ``marker_dir``: ``wrapper`` if our caller is
        ``WorkerWrapper.shutdown`` (which runs the stopping hook just before)."""
        from executor_core.backend import WorkerWrapper

        if self.marker_dir:
            wrapped = sys._getframe(1).f_code is WorkerWrapper.shutdown.__code__
            marker = Path(self.marker_dir, f"shutdown-{self.rank}")
            marker.write_text("wrapper" if wrapped else "direct")


_REPLACED = ("is_initialized", "current_device", "set_device")


class _StandIn:
    """``torch.cuda``'s current device, per thread, while a probe worker lives in the process."""

    lock: ClassVar[threading.Lock] = threading.Lock()
    users: ClassVar[int] = 0
    saved: ClassVar[dict[str, Any]] = {}
    local: ClassVar[threading.local] = threading.local()

    is_initialized = staticmethod(lambda: True)

    @classmethod
    def current_device(cls) -> int:
        return int(getattr(cls.local, "index", 0))

    @classmethod
    def set_device(cls, device: Any) -> None:
        cls.local.index = getattr(device, "index", device)

    @classmethod
    def use(cls, add: int) -> None:
        """Count a probe worker in (``add=1``) or out (``-1``); install or put back."""
        import torch

        with cls.lock:
            if cls.users == 0 and add > 0:
                cls.local = threading.local()
                cls.saved = {name: getattr(torch.cuda, name) for name in _REPLACED}
                for name in _REPLACED:
                    setattr(torch.cuda, name, getattr(cls, name))
            cls.users += add
            if cls.users == 0 and add < 0:
                for name, function in cls.saved.items():
                    setattr(torch.cuda, name, function)


class DeviceProbeWorker(ConformanceWorker):
    """A :class:`ConformanceWorker` whose process has a per-thread CUDA device stand-in; the
    real functions come back when the process's last probe worker shuts down."""

    def init_device(self) -> None:
        """Install the stand-in and make device ``local_rank + 1`` current on this thread."""
        import torch

        _StandIn.use(1)
        self.__dict__["_installed"] = True
        torch.cuda.set_device(self.local_rank + 1)
        super().init_device()

    def probe(self) -> tuple[str, int, int]:
        """``(thread name, current device, expected device)`` as this call sees them."""
        import torch

        current = torch.cuda.current_device()
        return threading.current_thread().name, current, self.local_rank + 1

    def execute_model(self, batch: Any) -> Any:
        """The probe, from the path the backend takes for ``execute_model``."""
        return self.probe()

    def shutdown(self) -> None:
        """Put the real ``torch.cuda`` functions back (with the process's last probe)."""
        if self.__dict__.pop("_installed", False):
            _StandIn.use(-1)
        super().shutdown()
