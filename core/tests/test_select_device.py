"""select_device on CUDA (mocked): each local rank takes its own GPU, or is refused."""

from __future__ import annotations

import pytest
import torch

from executor_core import WorkerContext
from executor_core.torch import select_device
from executor_core.torch._devices import visible_gpu_count


def _context(local_rank: int, local_world_size: int) -> WorkerContext:
    return WorkerContext(
        rank=local_rank,
        local_rank=local_rank,
        world_size=local_world_size,
        tensor_parallel_size=local_world_size,
        pipeline_parallel_size=1,
        distributed_init_method="tcp://127.0.0.1:1",
        device="cuda",
        local_world_size=local_world_size,
    )


@pytest.fixture
def set_to(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    made_current: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return made_current


def test_each_local_rank_takes_its_own_gpu(
    set_to: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert select_device(_context(1, 2)) == torch.device("cuda", 1)
    assert set_to == [1]


def test_a_second_rank_on_the_only_gpu_is_refused(
    set_to: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError, match=r"local rank 1 of 2 .* no GPU of its own: 1 visible"):
        select_device(_context(1, 2))
    assert set_to == []


def test_a_process_given_one_gpu_takes_it(
    set_to: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    assert select_device(_context(1, 2)) == torch.device("cuda", 0)
    assert set_to == [0]


def test_visible_gpu_count_reads_the_workers_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert visible_gpu_count() == 0  # this torch build sees no GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert visible_gpu_count() == 4
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "0,2"}) == 2
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "1,,3"}) == 1  # CUDA stops at a gap
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "-1"}) == 0
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "GPU-8f2e,GPU-77a1"}) == 2
