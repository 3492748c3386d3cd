"""Conformance kit, device: the worker's accelerator device is current on every thread that
runs one of its methods, whatever path the backend takes for the call.

CUDA keeps the current device per thread. The probe worker replaces ``torch.cuda``'s
current-device functions in its own process with a per-thread stand-in (this kit runs where
there is no GPU), makes device ``local_rank + 1`` current in ``init_device`` (so that it
differs from a fresh thread's device 0), and reports what each call sees.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from .._executor import Executor
from .._worker import WorkerContext
from ._base import ExecutorFactory, KitBase, check_reply_ranks
from ._guard import time_limit
from ._workers import ConformanceWorker

__all__ = ["DeviceProbeWorker", "DeviceTests"]


class _PerThreadDevice:
    """Stands in for ``torch.cuda``'s current device: one per thread, 0 until set, as in CUDA."""

    def __init__(self) -> None:
        self._local = threading.local()

    def is_initialized(self) -> bool:
        return True

    def current_device(self) -> int:
        index: int = getattr(self._local, "index", 0)
        return index

    def set_device(self, device: Any) -> None:
        self._local.index = device if isinstance(device, int) else int(device.index)


_REPLACED = ("is_initialized", "current_device", "set_device")


class _StandIn:
    """The stand-in of this process, installed while a probe worker lives in it (several
    workers may share a process: a thread-per-rank backend's)."""

    lock: ClassVar[threading.Lock] = threading.Lock()
    users: ClassVar[int] = 0
    saved: ClassVar[dict[str, Any]] = {}

    @classmethod
    def install(cls) -> None:
        import torch

        with cls.lock:
            if cls.users == 0:
                fake = _PerThreadDevice()
                cls.saved = {name: getattr(torch.cuda, name) for name in _REPLACED}
                for name in _REPLACED:
                    setattr(torch.cuda, name, getattr(fake, name))
            cls.users += 1

    @classmethod
    def uninstall(cls) -> None:
        import torch

        with cls.lock:
            cls.users -= 1
            if cls.users == 0:
                for name, function in cls.saved.items():
                    setattr(torch.cuda, name, function)
                cls.saved = {}


class DeviceProbeWorker(ConformanceWorker):
    """A :class:`ConformanceWorker` whose process has a per-thread CUDA device stand-in.

    The real functions come back when the last probe worker of the process shuts down (an
    in-process backend runs this in the test's own process).
    """

    def __init__(self, *, context: WorkerContext, **kwargs: Any) -> None:
        super().__init__(context=context, **kwargs)
        self._installed = False

    @property
    def expected_device(self) -> int:
        """The device this rank made current: ``local_rank + 1``."""
        return self.local_rank + 1

    def init_device(self) -> None:
        """Install the stand-in and make :attr:`expected_device` current on this thread."""
        import torch

        _StandIn.install()
        self._installed = True
        torch.cuda.set_device(self.expected_device)
        super().init_device()

    def probe(self) -> tuple[str, int, int]:
        """``(thread name, current device, expected device)`` as this call sees them."""
        import torch

        current = torch.cuda.current_device()
        return threading.current_thread().name, current, self.expected_device

    def execute_model(self, batch: Any) -> Any:
        """The probe, from the path the backend takes for ``execute_model``."""
        return self.probe()

    def shutdown(self) -> None:
        """Put the real ``torch.cuda`` functions back (with the process's last probe)."""
        if self._installed:
            self._installed = False
            _StandIn.uninstall()
        super().shutdown()


def _assert_devices(probes: list[Any], how: str) -> None:
    wrong = [
        f"rank {rank} on thread {thread!r} saw device {seen}, not {expected}"
        for rank, (thread, seen, expected) in enumerate(probes)
        if seen != expected
    ]
    assert not wrong, f"{how}: {'; '.join(wrong)}"


class DeviceTests(KitBase):
    """The device a worker made current in ``init_device`` is current in every call."""

    @pytest.fixture(scope="class")
    @classmethod
    def probed(cls, executor_factory: ExecutorFactory) -> Iterator[Executor]:
        """One executor of :class:`DeviceProbeWorker` for the class's device tests."""
        pytest.importorskip("torch", reason="the device probe stands in for torch.cuda")
        with time_limit(cls.time_limit_s, "creating the executor"):
            executor = executor_factory(worker_cls=DeviceProbeWorker)
        try:
            check_reply_ranks(executor, cls.reply_probe_s())
            yield executor
        finally:
            with time_limit(cls.time_limit_s, "shutdown()"):
                executor.shutdown()

    def test_device_is_current_in_blocking_calls(self, probed: Executor) -> None:
        _assert_devices(probed.collective_rpc("probe"), "a blocking call")

    def test_device_is_current_in_calls_with_a_timeout(self, probed: Executor) -> None:
        _assert_devices(probed.collective_rpc("probe", timeout=30.0), "a call with a timeout")

    def test_device_is_current_in_non_blocking_calls(self, probed: Executor) -> None:
        future = probed.collective_rpc("probe", non_block=True)
        _assert_devices(future.result(timeout=30.0), "a non-blocking call")

    def test_device_is_current_in_execute_model(self, probed: Executor) -> None:
        thread, seen, expected = probed.execute_model(None)
        assert seen == expected, f"execute_model on thread {thread!r} saw device {seen}"
        future = probed.execute_model(None, non_block=True)
        thread, seen, expected = future.result(timeout=30.0)
        assert seen == expected, f"execute_model(non_block) on {thread!r} saw device {seen}"

    def test_device_is_current_in_calls_from_other_driver_threads(self, probed: Executor) -> None:
        results: list[Any] = []

        def call() -> None:
            results.append(probed.collective_rpc("probe"))

        threads = [threading.Thread(target=call, name=f"driver-{i}") for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30.0)
        assert len(results) == len(threads), "a caller thread did not finish"
        for probes in results:
            _assert_devices(probes, "a call from another driver thread")
