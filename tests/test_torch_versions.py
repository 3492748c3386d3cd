"""The SDK's torch code on the torch releases it must run on, with this machine's torch.

The distributions declare torch>=2.4, and the lent GPU machine that scripts/gpu_check.py runs
on has torch 2.11.0+cu130. Every torch API newer than 2.4 that the code calls is looked up,
never assumed; these tests hide from this machine's torch each API that the release under
test lacks (:data:`NEWER_APIS`) and run what falls back: the torch helpers one by one, then
the reference worker on the in-process backend as gpu_check.py's CPU checks drive it.

What this cannot show: a CUDA build's own behaviour. The CUDA calls are stood in for where a
test needs CUDA initialised; the real ones run on a GPU (scripts/gpu_check.py).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from packaging.version import Version

from executor_core import ExecutorConfig, create_executor
from executor_core._wrapper import _device_setter
from executor_core.torch import device_memory, pinned_host_bytes, release_pinned_host_memory
from executor_core.torch._devices import _dist_backend
from executor_reference import MODEL_SIZES, ensure_checkpoint, generate, make_prompts

#: Each torch API newer than 2.4 that the SDK's code reaches: the first release that has it,
#: and whether only CUDA builds have it (this machine's CPU build does not).
NEWER_APIS: dict[str, tuple[str, bool]] = {
    "torch._C._host_emptyCache": ("2.5", True),
    "torch.accelerator": ("2.6", False),
    "torch.distributed.distributed_c10d._abort_process_group": ("2.5", False),
    "torch.distributed.get_default_backend_for_device": ("2.6", False),
    "torch.cuda.host_memory_stats": ("2.7", False),
    "torch.accelerator.empty_host_cache": ("2.12", False),
}
#: The lowest release the distributions declare, and the lent GPU machine's.
RELEASES = ("2.4", "2.11")


def _owner(dotted: str) -> tuple[Any, str]:
    """The object that holds ``dotted``'s last part (None when it is itself hidden)."""
    parent, _, name = dotted.rpartition(".")
    owner: Any = torch
    for part in parent.split(".")[1:]:
        owner = getattr(owner, part, None)
    return owner, name


def _lacks(release: str) -> list[str]:
    return [api for api, (since, _) in NEWER_APIS.items() if Version(since) > Version(release)]


def _as_release(monkeypatch: pytest.MonkeyPatch, release: str) -> None:
    """Make this machine's torch look like ``release`` (a CUDA build of it): its newer APIs
    hidden, and the CUDA-only ones that ``release`` has stood in for."""
    for api, (since, cuda_only) in sorted(NEWER_APIS.items(), key=lambda i: -i[0].count(".")):
        owner, name = _owner(api)  # the deepest first: torch.accelerator's own go first
        if Version(since) > Version(release):
            monkeypatch.delattr(owner, name, raising=False)
        elif cuda_only and not hasattr(owner, name):
            monkeypatch.setattr(owner, name, lambda: None, raising=False)


@pytest.fixture(params=RELEASES, ids=lambda r: f"torch{r}")
def release(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The release under test, this machine's torch made to look like it."""
    _as_release(monkeypatch, request.param)
    return str(request.param)


def test_this_torch_has_every_api_the_table_says_it_has() -> None:
    # The table is what the tests hide: an API it dates wrongly would go untested.
    this = Version(torch.__version__).release[:2]
    for api, (since, cuda_only) in NEWER_APIS.items():
        if Version(since).release <= this and not (cuda_only and torch.version.cuda is None):
            owner, name = _owner(api)
            assert hasattr(owner, name), f"{api} (since torch {since}) is missing"


def test_the_hidden_apis_are_gone(release: str) -> None:
    hidden = _lacks(release)
    assert hidden, "a release that lacks nothing tests no fallback"
    for api in hidden:
        owner, name = _owner(api)
        assert owner is None or not hasattr(owner, name), api


def test_the_cuda_device_is_carried_to_other_threads(
    release: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _device_setter() is None  # nothing initialised, nothing to carry
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda i: calls.append((threading.current_thread().name, i))
    )
    setter = _device_setter()
    assert setter is not None
    thread = threading.Thread(target=setter, name="runner")
    thread.start()
    thread.join()
    assert calls == [("runner", 1)]


def test_pinned_host_memory_is_released_and_measured(
    release: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    if hasattr(torch._C, "_host_emptyCache"):  # 2.5 to 2.11: the private hook is the way
        monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append("private"))
    if hasattr(torch.cuda, "host_memory_stats"):
        monkeypatch.setattr(torch.cuda, "host_memory_stats", lambda: {"reserved_bytes.current": 7})
    released = release_pinned_host_memory()
    measured = pinned_host_bytes()
    if release == "2.11":
        assert (released, calls, measured) == (True, ["private"], 7)
    else:  # 2.4: no way to empty torch's pinned cache, nor to measure it: said, not raised
        assert (released, calls, measured) == (False, [], None)


def test_the_collective_backend_of_another_device_type(
    release: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(dist.Backend.default_device_backend_map, "xpu", "xccl-test")
    assert _dist_backend(torch.device("xpu", 0)) == "xccl-test"
    assert _dist_backend(torch.device("cuda", 0)) == "nccl"
    monkeypatch.delitem(dist.Backend.default_device_backend_map, "xpu")
    with pytest.raises(ValueError, match="xpu"):
        _dist_backend(torch.device("xpu", 0))


def test_another_accelerators_memory_needs_torch_accelerator(release: str) -> None:
    if release == "2.4":
        with pytest.raises(ValueError, match=r"cannot measure the memory of 'xpu' devices"):
            device_memory(torch.device("xpu", 0))
    cpu = device_memory(torch.device("cpu"))
    assert 0 < cpu.reserved_bytes <= cpu.total_bytes


def _thread(_worker: Any) -> str:
    return threading.current_thread().name


def test_the_reference_worker_runs_gpu_checks_cpu_paths(release: str, tmp_path: Path) -> None:
    """What gpu_check.py's sleep_wake, timing and device_per_thread_uni checks run on the CPU,
    in this process (the uni backend), with the release's APIs only."""
    checkpoint = ensure_checkpoint(MODEL_SIZES["tiny"], tmp_path)
    config = ExecutorConfig(
        backend="uni",
        worker_cls="executor_reference:ReferenceWorker",
        worker_kwargs={"checkpoint": str(checkpoint), "kv_slots": 4, "cpu_threads": 1},
        device="cpu",
        rpc_timeout=60,  # calls run on the backend's runner thread
    )
    prompts = make_prompts(2, 4, MODEL_SIZES["tiny"].vocab_size, seed=1)
    with create_executor(config) as executor:
        before = generate(executor, prompts, max_new_tokens=4, batch_size=2)
        assert 0.0 <= before.executor_share < 1.0
        for level in (1, 2):
            executor.sleep(level)
            asleep = executor.collective_rpc("memory_usage")[0]
            assert asleep["weight_bytes"] == 0
            executor.wake_up()
            after = generate(executor, prompts, max_new_tokens=4, batch_size=2)
            assert after.tokens == before.tokens, level
        [thread] = executor.collective_rpc(_thread)
        assert thread != threading.main_thread().name  # the runner thread's device path
