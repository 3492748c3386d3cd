"""The reference worker on a device: its step clock stops when the device has finished the
step, a failed sleep leaves it awake and able to sleep again, and on CUDA sleep gives the
device's memory back (and wake the pinned host memory).

The CUDA tests run where torch sees a GPU and are skipped elsewhere; the rest run on the CPU,
with the device's wait stood in for where it matters.
"""

from __future__ import annotations

import errno
import io
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from executor_core import Executor, ExecutorConfig, WorkerError, create_executor
from executor_core.backend import default_registry
from executor_core.torch import _offload
from executor_reference import (
    MODEL_SIZES,
    StepInput,
    ensure_checkpoint,
    generate,
    make_prompts,
)
from executor_reference import _worker as reference_worker

TINY = MODEL_SIZES["tiny"]
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no GPU")


def _config(checkpoint: Path, device: str = "cpu") -> ExecutorConfig:
    return ExecutorConfig(
        backend="uni",
        worker_cls="executor_reference:ReferenceWorker",
        worker_kwargs={"checkpoint": str(checkpoint), "kv_slots": 16, "cpu_threads": 1},
        device=device,
        rpc_timeout=120,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_checkpoint(TINY, tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def uni(checkpoint: Path) -> Iterator[Executor]:
    with create_executor(_config(checkpoint)) as executor:
        yield executor


def _step() -> StepInput:
    return StepInput(batch_id=7, slots=[0, 1], token_ids=[[1, 2, 3], [4, 5, 6]], start_pos=0)


# --- step timing ------------------------------------------------------------------------------


class _Stream:
    def __init__(self, calls: list[Any], device: torch.device) -> None:
        self.calls = calls
        self.device = device

    def synchronize(self) -> None:
        self.calls.append(("stream.synchronize", self.device))


def test_on_cuda_the_step_waits_for_the_current_stream_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: _Stream(calls, device))

    def device_wide(device: Any = None) -> None:
        # It would also wait for a send to the next stage, on NCCL's stream: for the next
        # stage to receive it.
        raise AssertionError("the step must not wait for every stream of the device")

    monkeypatch.setattr(torch.cuda, "synchronize", device_wide)
    reference_worker._wait_for_device(torch.device("cuda", 1))
    assert calls == [("stream.synchronize", torch.device("cuda", 1))]


def test_on_the_cpu_a_step_waits_for_nothing(
    uni: Executor, monkeypatch: pytest.MonkeyPatch
) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a CPU step touched CUDA")

    monkeypatch.setattr(torch.cuda, "current_stream", forbidden)
    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    reference_worker._wait_for_device(torch.device("cpu"))
    output = uni.execute_model(_step())
    assert output.batch_id == 7
    assert len(output.next_tokens) == 2


def test_the_step_clock_stops_after_the_device_has_finished(
    uni: Executor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in for a GPU still running the step when forward returns: the clock must not
    stop before the wait for it is over, or the GPU's time would count as the executor's."""
    busy_s = 0.2
    waits: list[tuple[torch.device, float]] = []

    def device_still_busy(device: torch.device) -> None:
        time.sleep(busy_s)
        waits.append((device, time.perf_counter()))

    monkeypatch.setattr(reference_worker, "_wait_for_device", device_still_busy)
    submitted = time.perf_counter()
    output = uni.execute_model(_step())
    returned = time.perf_counter()
    [(device, waited_until)] = waits
    assert device == torch.device("cpu")
    assert submitted <= output.started_at < waited_until <= output.finished_at <= returned
    assert output.model_time_s == pytest.approx(output.finished_at - output.started_at)
    assert output.model_time_s >= busy_s
    # What generate() and `executor run` show: the device's time is the model's, and the
    # executor's share of the step stays small.
    result = generate(uni, [[1, 2, 3]], max_new_tokens=1)
    [record] = result.steps
    assert record.model_time_s >= busy_s
    assert record.executor_time_s < 0.25 * busy_s
    assert result.executor_share < 0.25


# --- a failed sleep ---------------------------------------------------------------------------


def test_a_failed_sleep_leaves_the_worker_awake_and_able_to_sleep_again(
    uni: Executor, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = make_prompts(2, 5, TINY.vocab_size, seed=3)
    before = generate(uni, prompts, max_new_tokens=3).tokens
    [awake] = uni.collective_rpc("memory_usage")
    write_all = _offload._write_all
    writes: list[int] = []

    def disk_fills(file: io.FileIO, view: memoryview) -> None:
        writes.append(len(view))
        if len(writes) == 4:  # part-way through the weights
            file.write(view[: len(view) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write_all(file, view)

    monkeypatch.setattr(_offload, "_write_all", disk_fills)
    with pytest.raises(WorkerError, match="No space left"):
        uni.sleep(1)
    assert uni.sleeping_tags == frozenset()
    [after] = uni.collective_rpc("memory_usage")
    assert after["weight_bytes"] == awake["weight_bytes"] > 0
    assert after["kv_cache_bytes"] == awake["kv_cache_bytes"] > 0
    assert after["offloaded_bytes"] == 0
    assert generate(uni, prompts, max_new_tokens=3).tokens == before
    monkeypatch.undo()
    uni.sleep(1)  # the offloader was left usable
    try:
        [asleep] = uni.collective_rpc("memory_usage")
        assert asleep["weight_bytes"] == 0
        assert asleep["offloaded_bytes"] == awake["weight_bytes"]
    finally:
        uni.wake_up()
    assert generate(uni, prompts, max_new_tokens=3).tokens == before


def test_memory_usage_reports_the_device_on_the_cpu(uni: Executor) -> None:
    [usage] = uni.collective_rpc("memory_usage")
    assert usage["device_bytes"] == usage["host_bytes"] == usage["device_allocated_bytes"]
    assert 0 < usage["device_bytes"] <= usage["device_used_bytes"] <= usage["device_total_bytes"]
    assert usage["pinned_host_bytes"] == 0


# --- on a GPU -------------------------------------------------------------------------------
#
# The workers run in processes of their own (``mp``), so that this test process never
# initialises CUDA. Their probes are defined inside the tests: cloudpickle then sends them by
# value (a worker process cannot import this test module).


def _cuda_config(checkpoint: Path) -> ExecutorConfig:
    if "mp" not in {spec.name for spec in default_registry().backends()}:
        pytest.skip("the mp backend is not installed")
    return attrs.evolve(_config(checkpoint, device="cuda"), backend="mp")


@pytest.fixture(scope="module")
def cuda_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # medium: 124 MB of weights and 268 MB of KV cache, far above the allocator's rounding
    return ensure_checkpoint(MODEL_SIZES["medium"], tmp_path_factory.mktemp("cuda"))


@NEEDS_CUDA
@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_device_memory_and_wake_takes_it_back_on_cuda(
    cuda_checkpoint: Path, level: int
) -> None:
    def probe(worker: Any) -> dict[str, int]:
        """On the worker: its memory_usage() and torch's own figures, read directly."""
        import torch

        device = worker.state.device
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        figures: dict[str, int] = dict(worker.memory_usage())
        figures["torch_reserved"] = int(torch.cuda.memory_reserved(device))
        figures["torch_used"] = int(total - free)
        stats = torch.cuda.host_memory_stats()  # pinned by torch, in use or cached
        figures["torch_pinned"] = int(
            stats.get("reserved_bytes.current", stats.get("allocated_bytes.current", -1))
        )
        return figures

    prompts = make_prompts(4, 16, MODEL_SIZES["medium"].vocab_size, seed=2)
    with create_executor(_cuda_config(cuda_checkpoint)) as executor:
        before = generate(executor, prompts, max_new_tokens=4).tokens
        [awake] = executor.collective_rpc(probe)
        executor.sleep(level)
        [asleep] = executor.collective_rpc(probe)
        executor.wake_up()
        [woken] = executor.collective_rpc(probe)
        after = generate(executor, prompts, max_new_tokens=4).tokens
    held = awake["weight_bytes"] + awake["kv_cache_bytes"]
    report = {"level": level, "awake": awake, "asleep": asleep, "woken": woken}
    assert held > 300 * 2**20, report
    for key in ("torch_reserved", "torch_used"):
        # Sleep gives the weights and the KV cache back to the driver; wake takes them again.
        assert awake[key] - asleep[key] >= 0.8 * held, (key, report)
        assert woken[key] - asleep[key] >= 0.8 * held, (key, report)
    # What memory_usage reports is what torch says.
    for figures in (awake, asleep, woken):
        assert figures["device_bytes"] == figures["torch_reserved"], report
        assert figures["device_used_bytes"] == figures["torch_used"], report
        assert figures["device_allocated_bytes"] <= figures["device_bytes"], report
        assert figures["pinned_host_bytes"] == figures["torch_pinned"], report
    assert asleep["weight_bytes"] == asleep["kv_cache_bytes"] == 0
    if level == 1:
        # The weights wait in pinned host memory, which goes back to the OS on wake.
        assert asleep["offloaded_bytes"] == awake["weight_bytes"]
        assert asleep["torch_pinned"] >= awake["torch_pinned"] + awake["weight_bytes"], report
    assert woken["torch_pinned"] <= awake["torch_pinned"], report
    assert after == before


@NEEDS_CUDA
def test_the_step_clock_counts_the_gpus_work(cuda_checkpoint: Path) -> None:
    """GPU work queued just before a step delays the step's kernels: the step's clock must
    wait for them (without the wait it stopped at the last launch, a few ms in)."""
    cycles = 1 << 28

    def time_gpu_work(worker: Any, cycles: int) -> float:
        import time

        import torch

        torch.cuda.synchronize()
        start = time.perf_counter()
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def queue_gpu_work(worker: Any, cycles: int) -> None:
        import torch

        # On the default stream, which the worker's steps use too; returns at once.
        torch.cuda._sleep(cycles)

    with create_executor(_cuda_config(cuda_checkpoint)) as executor:
        executor.execute_model(_step())  # warm up
        [busy_s] = executor.collective_rpc(time_gpu_work, args=(cycles,))
        executor.collective_rpc(queue_gpu_work, args=(cycles,))
        output = executor.execute_model(_step())
    assert busy_s > 0.02, busy_s
    assert output.model_time_s >= 0.8 * busy_s, (output.model_time_s, busy_s)
