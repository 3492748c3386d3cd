"""Device: the worker's accelerator device is current on every thread that runs one of its
methods, whatever path the backend takes for the call.

CUDA keeps the current device per thread. The probe worker replaces ``torch.cuda``'s
current-device functions in its own process with a per-thread stand-in (the kit runs where
there is no GPU), makes device ``local_rank + 1`` current in ``init_device`` (a fresh thread
has device 0), and reports what each call sees.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from executor_core import Executor, WorkerContext

from ._base import ExecutorFactory, KitBase
from ._workers import ConformanceWorker

__all__ = ["DeviceProbeWorker", "DeviceTests"]

_REPLACED = ("is_initialized", "current_device", "set_device")


class _StandIn:
    """``torch.cuda``'s current device, per thread, while a probe worker lives in this process
    (several may share one: a thread-per-rank backend's, or the test's own)."""

    lock: ClassVar[threading.Lock] = threading.Lock()
    users: ClassVar[int] = 0
    saved: ClassVar[dict[str, Any]] = {}
    local: ClassVar[threading.local] = threading.local()

    @staticmethod
    def is_initialized() -> bool:
        return True

    @classmethod
    def current_device(cls) -> int:
        index: int = getattr(cls.local, "index", 0)
        return index

    @classmethod
    def set_device(cls, device: Any) -> None:
        cls.local.index = device if isinstance(device, int) else int(device.index)

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

    def __init__(self, *, context: WorkerContext, **kwargs: Any) -> None:
        super().__init__(context=context, **kwargs)
        self._installed = False

    def init_device(self) -> None:
        """Install the stand-in and make device ``local_rank + 1`` current on this thread."""
        import torch

        _StandIn.use(1)
        self._installed = True
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
        if self._installed:
            self._installed = False
            _StandIn.use(-1)
        super().shutdown()


def _assert_devices(probes: list[Any], how: str) -> None:
    wrong = [
        f"rank {rank} on thread {thread!r} saw device {seen}, not {expected}"
        for rank, (thread, seen, expected) in enumerate(probes)
        if seen != expected
    ]
    assert not wrong, f"rule broken: the worker's device is current in {how}: {'; '.join(wrong)}"


class DeviceTests(KitBase):
    """The device a worker made current in ``init_device`` is current in every call."""

    @pytest.fixture(scope="class")
    @classmethod
    def probed(cls, executor_factory: ExecutorFactory) -> Iterator[Executor]:
        """One executor of :class:`DeviceProbeWorker` for the class's device tests."""
        pytest.importorskip("torch", reason="the device probe stands in for torch.cuda")
        yield from cls._shared(executor_factory, worker_cls=DeviceProbeWorker)

    def test_device_is_current_in_every_kind_of_call(self, probed: Executor) -> None:
        """Rule: blocking calls, calls with a timeout, non-blocking calls and
        ``execute_model`` (blocking and not) run with the worker's device current."""
        _assert_devices(probed.collective_rpc("probe"), "a blocking call")
        _assert_devices(probed.collective_rpc("probe", timeout=30.0), "a call with a timeout")
        future = probed.collective_rpc("probe", non_block=True)
        _assert_devices(future.result(timeout=30.0), "a non-blocking call")
        _assert_devices([probed.execute_model(None)], "execute_model")
        future = probed.execute_model(None, non_block=True)
        _assert_devices([future.result(timeout=30.0)], "execute_model(non_block=True)")

    def test_device_is_current_in_calls_from_other_driver_threads(self, probed: Executor) -> None:
        results: list[Any] = []
        threads = [
            threading.Thread(target=lambda: results.append(probed.collective_rpc("probe")))
            for _ in range(2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30.0)
        assert len(results) == len(threads), "a caller thread did not finish"
        for probes in results:
            _assert_devices(probes, "a call from another driver thread")
