"""Shared by the engine tests: vLLM's real engine on the tiny model, and the checks that an
engine left nothing behind (processes, /dev/shm segments, socket files, temp dirs)."""

from __future__ import annotations

import contextlib
import gc
import glob
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from executor_vllm import PROMPTS, TINY_ENGINE_ARGS, one_core_per_rank

#: Tokens generated per prompt: enough to see divergence, few enough to stay cheap.
MAX_TOKENS = 12
ADAPTER = "executor_vllm.SdkExecutor"


def engine_env(tp: int) -> dict[str, str]:
    """The environment an engine of ``tp`` ranks runs in on a CPU of this size: one core per
    rank (one NUMA node, so no ``auto`` binding), the engine core in this process."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")}
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = one_core_per_rank(tp)
    return env


@contextlib.contextmanager
def patched_env(values: dict[str, str]) -> Iterator[None]:
    old = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def _ours() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "executor-vllm-*")))


def _children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


def snapshot() -> tuple[set[str], set[str], set[int]]:
    """What /dev/shm and the temp dir hold, and this process's children (another test's Ray
    session, say), now: for :func:`assert_nothing_left`."""
    return _shm(), _ours(), _children()


@contextlib.contextmanager
def engine(
    model: Path,
    backend: str | None = None,
    tp: int = 1,
    *,
    executor: str = ADAPTER,
    options: dict[str, Any] | None = None,
    check: bool = True,
    check_sockets: bool = True,
    **llm_kwargs: Any,
) -> Iterator[Any]:
    """An ``LLM`` on ``executor`` (the adapter on ``backend`` by default), shut down at the
    end; then nothing it started may be left (with ``check``; vLLM's own executors are only
    cleaned after)."""
    from vllm import LLM

    rpc_dir = tempfile.mkdtemp(prefix="vllm-test-rpc-")
    before = snapshot()
    section: dict[str, Any] = {}
    if backend is not None:
        section["backend"] = backend
    if options is not None:
        section["backend_options"] = options
    extra = {"additional_config": {"executor_sdk": section}} if section else {}
    llm = None
    try:
        with patched_env({**engine_env(tp), "VLLM_RPC_BASE_PATH": rpc_dir}):
            llm = LLM(
                model=str(model),
                **TINY_ENGINE_ARGS,
                distributed_executor_backend=executor,
                tensor_parallel_size=tp,
                **extra,
                **llm_kwargs,
            )
            yield llm
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        from vllm.distributed import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
        try:
            if check:
                assert_nothing_left(before, rpc_dir if check_sockets else None)
        finally:
            # vLLM's own executors leave their CPU communicator's segments: never left for
            # the next test (only those: another process may own the rest).
            for name in _shm() - before[0]:
                if "cpushm" not in name:
                    continue
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join("/dev/shm", name))
            for path in glob.glob(os.path.join(rpc_dir, "*")):
                os.unlink(path)
            os.rmdir(rpc_dir)


def assert_nothing_left(before: tuple[set[str], set[str], set[int]], rpc_dir: str | None) -> None:
    """Nothing was left since ``before`` (a :func:`snapshot`): no process (but
    multiprocessing's resource tracker, one per process for its life), no /dev/shm segment, no
    executor-vllm temp dir, and no file in ``rpc_dir`` (unless None)."""
    shm_before, ours_before, children_before = before
    children = [
        child
        for child in psutil.Process().children(recursive=True)
        if child.pid not in children_before and "resource_tracker" not in " ".join(_cmdline(child))
    ]
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"processes left running: {[p.pid for p in alive]}"
    assert _shm() - shm_before == set(), f"/dev/shm segments left: {_shm() - shm_before}"
    assert _ours() - ours_before == set(), "executor-vllm temp dirs left"
    if rpc_dir is not None:
        assert os.listdir(rpc_dir) == [], "socket files left in VLLM_RPC_BASE_PATH"


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def generate(llm: Any, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Greedy tokens for every prompt of :data:`PROMPTS`."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(list(PROMPTS), params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


def model_executor(llm: Any) -> Any:
    """The executor of an engine whose core runs in this process."""
    return llm.llm_engine.engine_core.engine_core.model_executor
