"""The worker's device is carried to other threads: what is captured, and how often it is set."""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import pytest
import torch

from executor_core._thread_device import ThreadDevice, capture_thread_device


def test_nothing_to_carry_without_an_initialised_accelerator() -> None:
    assert not torch.cuda.is_initialized()
    assert capture_thread_device() is None


def test_the_current_cuda_device_is_captured(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)

    def set_device(index: int) -> None:
        calls.append((threading.current_thread().name, index))

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    device = capture_thread_device()
    assert device is not None
    device.bind()  # the capturing thread already has it
    assert calls == []
    thread = threading.Thread(target=device.bind, name="other")
    thread.start()
    thread.join()
    assert calls == [("other", 3)]


def test_each_thread_sets_the_device_once() -> None:
    calls: list[str] = []
    device = ThreadDevice(lambda: calls.append(threading.current_thread().name))

    def twice() -> None:
        device.bind()
        device.bind()

    threads = [threading.Thread(target=twice, name=f"t{i}") for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(calls) == ["t0", "t1", "t2"]


def test_other_accelerators_through_torch_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    class FakeModule:
        set_to: ClassVar[list[Any]] = []

        @staticmethod
        def is_initialized() -> bool:
            return True

        @staticmethod
        def current_device() -> int:
            return 2

        @staticmethod
        def set_device(index: int) -> None:
            FakeModule.set_to.append(index)

    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("xpu"))
    monkeypatch.setattr(torch, "get_device_module", lambda kind: FakeModule)
    device = capture_thread_device()
    assert device is not None
    thread = threading.Thread(target=device.bind)
    thread.start()
    thread.join()
    assert FakeModule.set_to == [2]
