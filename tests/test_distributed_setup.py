"""init_distributed forms every communicator at start-up and names the rank when it cannot."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist

from executor_core import (
    ExecutorConfig,
    WorkerBase,
    WorkerContext,
    WorkerError,
    create_executor,
)
from executor_core.torch import ParallelState, init_distributed


class CountingWorker(WorkerBase):
    """Joins torch.distributed in init_device, counting the collectives set-up runs."""

    def init_device(self) -> None:
        counts = self.counts = {"all_reduce": 0, "isend": 0, "recv": 0}

        def counted(name: str) -> Any:
            real = getattr(dist, name)

            def call(*args: Any, **kwargs: Any) -> Any:
                counts[name] += 1
                return real(*args, **kwargs)

            return call

        real = {name: getattr(dist, name) for name in counts}
        for name in counts:
            setattr(dist, name, counted(name))
        try:
            self.state: ParallelState = init_distributed(self.context, timeout_s=60.0)
        finally:
            for name, function in real.items():
                setattr(dist, name, function)

    def set_up_collectives(self) -> dict[str, int]:
        return self.counts

    def shutdown(self) -> None:
        self.state.destroy()


@pytest.mark.slow  # several seconds: a gloo group per stage hop
def test_warm_up_touches_every_group_and_every_stage_hop() -> None:
    config = ExecutorConfig(
        worker_cls=CountingWorker,
        backend="mp",
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
    )
    with create_executor(config) as executor:
        counts = executor.collective_rpc("set_up_collectives")
    # world + TP group + PP group on every rank; stage 0 sends, stage 1 receives.
    assert [c["all_reduce"] for c in counts] == [3, 3, 3, 3]
    assert [c["isend"] for c in counts] == [1, 1, 0, 0]
    assert [c["recv"] for c in counts] == [0, 0, 1, 1]


def test_a_set_up_failure_raises_in_create_executor_naming_the_rank() -> None:
    config = ExecutorConfig(
        worker_cls=CountingWorker,
        backend="mp",
        tensor_parallel_size=2,
        env={"GLOO_SOCKET_IFNAME": "executor-no-such-interface"},
    )
    with pytest.raises(WorkerError) as caught:
        create_executor(config)
    message = str(caught.value)
    # Both ranks fail; the error is the first one reported, with its rank.
    assert re.search(r"worker rank (\d) raised .*: rank \1 \(local rank \1 on ", message)
    assert "setting up torch.distributed (gloo) failed in joining the process group" in message
    assert "executor-no-such-interface" in message


def _cuda_context(rank: int) -> WorkerContext:
    """Rank ``rank`` of two pipeline stages, each alone on its node with one GPU."""
    return WorkerContext(
        rank=rank,
        local_rank=0,
        world_size=2,
        tensor_parallel_size=1,
        pipeline_parallel_size=2,
        distributed_init_method="tcp://127.0.0.1:1",
        device="cuda",
        node_id=f"node-{rank}",
    )


class _Work:
    def wait(self) -> None:
        pass


@pytest.fixture
def fake_cuda_dist(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """torch.distributed and CUDA replaced by recorders: the calls set-up makes, in order."""
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: calls.append(("sync", device)))
    real_zeros, real_empty = torch.zeros, torch.empty
    monkeypatch.setattr(torch, "zeros", lambda *a, device=None, **k: real_zeros(*a, **k))
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **k: real_empty(*a, **k))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(("init", kwargs)))
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: ("group", tuple(ranks)))
    monkeypatch.setattr(
        dist, "all_reduce", lambda t, group=None: calls.append(("all_reduce", group))
    )

    def isend(tensor: torch.Tensor, dst: int) -> _Work:
        calls.append(("isend", dst))
        return _Work()

    monkeypatch.setattr(dist, "isend", isend)
    monkeypatch.setattr(dist, "recv", lambda tensor, src: calls.append(("recv", src)))
    return calls


def test_nccl_is_bound_to_the_gpu_and_warmed_up(fake_cuda_dist: list[tuple[str, Any]]) -> None:
    state = init_distributed(_cuda_context(1))
    assert state.backend == "nccl"
    init = dict(fake_cuda_dist)["init"]
    assert init["backend"] == "nccl"
    assert init["device_id"] == torch.device("cuda", 0)
    after_init = [name for name, _ in fake_cuda_dist][2:]
    assert fake_cuda_dist[:2] == [("set_device", 0), ("init", init)]
    assert after_init == ["all_reduce", "all_reduce", "recv", "sync"]
    assert fake_cuda_dist[3] == ("all_reduce", ("group", (0, 1)))  # the PP group
    assert fake_cuda_dist[-1] == ("sync", torch.device("cuda", 0))


def test_first_stage_sends_during_warm_up(fake_cuda_dist: list[tuple[str, Any]]) -> None:
    init_distributed(_cuda_context(0))
    assert ("isend", 1) in fake_cuda_dist
    assert not any(name == "recv" for name, _ in fake_cuda_dist)


def test_a_warm_up_failure_names_the_rank(
    fake_cuda_dist: list[tuple[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(tensor: torch.Tensor, group: object = None) -> None:
        raise RuntimeError("NCCL error: invalid usage (Duplicate GPU detected)")

    monkeypatch.setattr(dist, "all_reduce", broken)
    with pytest.raises(
        RuntimeError,
        match=r"rank 1 \(local rank 0 on node-1\): .*\(nccl\) "
        r"failed in the warm-up collectives: .*Duplicate GPU",
    ):
        init_distributed(_cuda_context(1))


def _reuse_group(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """This process already joined a two-rank group as rank 1, with ``backend``."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_backend", lambda: backend)


@pytest.mark.parametrize("backend", ["gloo", "cpu:gloo"])
@pytest.mark.usefixtures("fake_cuda_dist")
def test_a_reused_gloo_group_is_refused_on_cuda(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _reuse_group(monkeypatch, backend)
    with pytest.raises(RuntimeError, match=r"cannot carry CUDA tensors.*backend='nccl'"):
        init_distributed(_cuda_context(1))


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_a_reused_group_that_carries_cuda_is_kept(
    backend: str, fake_cuda_dist: list[tuple[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    _reuse_group(monkeypatch, backend)
    state = init_distributed(_cuda_context(1))
    assert state.backend == backend
    assert not any(name == "init" for name, _ in fake_cuda_dist)
