"""The worker's device is carried to other threads: what is captured, and how often it is set
(``WorkerWrapper`` makes the device its worker left current current on each thread that runs
one of its methods, once per thread)."""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import pytest
import torch

from executor_core import WorkerBase, WorkerContext
from executor_core._wrapper import _device_setter
from executor_core.backend import WorkerWrapper


class _Worker(WorkerBase):
    def where(self) -> str:
        return threading.current_thread().name


def _wrapper() -> WorkerWrapper:
    context = WorkerContext(
        rank=0,
        local_rank=0,
        world_size=1,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        distributed_init_method="tcp://127.0.0.1:1",
    )
    wrapper = WorkerWrapper(_Worker, {}, context)
    wrapper.init_worker()
    return wrapper


def test_nothing_to_carry_without_an_initialised_accelerator() -> None:
    assert not torch.cuda.is_initialized()
    assert _device_setter() is None


def test_each_other_thread_gets_the_cuda_device_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda i: calls.append((threading.current_thread().name, i))
    )
    wrapper = _wrapper()
    assert wrapper.run_method("where") == threading.current_thread().name
    assert calls == []  # the thread that built the worker has its device already

    def twice() -> None:
        wrapper.run_method("where")
        wrapper.run_method("where")

    threads = [threading.Thread(target=twice, name=f"t{i}") for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(calls) == [("t0", 3), ("t1", 3), ("t2", 3)]


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
    setter = _device_setter()
    assert setter is not None
    thread = threading.Thread(target=setter)
    thread.start()
    thread.join()
    assert FakeModule.set_to == [2]
