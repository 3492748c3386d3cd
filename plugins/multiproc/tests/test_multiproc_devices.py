"""What mp refuses before any worker starts: fewer GPUs than workers, fork after CUDA."""

from __future__ import annotations

import time
from collections.abc import Iterator

import psutil  # type: ignore[import-untyped]  # psutil ships no type information
import pytest
import torch

from executor_core import ConfigError, ExecutorConfig, create_executor
from executor_core.testing import ConformanceWorker


def _config(**overrides: object) -> ExecutorConfig:
    fields: dict[str, object] = {
        "worker_cls": ConformanceWorker,
        "backend": "mp",
        "tensor_parallel_size": 2,
    }
    fields.update(overrides)
    return ExecutorConfig(**fields)  # type: ignore[arg-type]  # the fields' own types


@pytest.fixture
def no_worker_started() -> Iterator[None]:
    """Fails the test if a child process was started, or if the refusal took long."""
    me = psutil.Process()
    before = {child.pid for child in me.children(recursive=True)}
    start = time.monotonic()
    yield
    assert time.monotonic() - start < 5.0, "the refusal waited for something"
    after = {child.pid for child in me.children(recursive=True)}
    assert after <= before, f"worker processes were started: {sorted(after - before)}"


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process sees one GPU (without initialising CUDA, as the driver must not)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.mark.usefixtures("no_worker_started")
def test_cuda_without_a_gpu_is_refused() -> None:
    assert not torch.cuda.is_available()
    with pytest.raises(ConfigError, match=r"2 workers on this node need a GPU each, but 0 are"):
        create_executor(_config(device="cuda"))


@pytest.mark.usefixtures("no_worker_started", "gpus")
def test_two_ranks_on_one_gpu_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"2 workers .* but 1 is visible") as caught:
        create_executor(_config(device="cuda"))
    assert "lower tensor_parallel_size" in str(caught.value)


@pytest.mark.usefixtures("no_worker_started", "gpus")
def test_the_workers_visible_devices_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    with pytest.raises(ConfigError, match=r"CUDA_VISIBLE_DEVICES='3' in config.env"):
        create_executor(_config(device="cuda", env={"CUDA_VISIBLE_DEVICES": "3"}))


@pytest.mark.usefixtures("no_worker_started")
def test_fork_after_cuda_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ConfigError, match=r"start_method='spawn'") as caught:
        create_executor(_config(backend_options={"start_method": "fork"}))
    assert "Cannot re-initialize CUDA in forked subprocess" in str(caught.value)


def test_spawn_after_cuda_is_fine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with create_executor(_config()) as executor:
        assert executor.collective_rpc("get_rank") == [0, 1]
