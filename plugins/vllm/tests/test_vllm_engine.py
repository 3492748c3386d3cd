"""vLLM's real engine on the adapter: the same greedy tokens as vLLM's own executors, every
call the engine makes, and nothing left behind. One engine per test; the references (vLLM's
own ``uni`` and ``mp``) once per module."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from engine import (
    MAX_TOKENS,
    assert_nothing_left,
    engine,
    generate,
    model_executor,
    snapshot,
)

from executor_core import (
    ConfigError,
    ExecutorError,
    UnknownBackendError,
    WorkerDiedError,
    WorkerError,
)
from executor_vllm import make_tiny_model

pytestmark = [
    pytest.mark.slow,
    # vLLM's own imports warn (deprecated torch names); they are not this package's.
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def vllm_uni(model: Path) -> list[list[int]]:
    """vLLM's own single-process executor's tokens."""
    with engine(model, executor="uni", check=False) as llm:
        return generate(llm)


@pytest.fixture(scope="module")
def vllm_mp(model: Path) -> list[list[int]]:
    """vLLM's own multiprocess executor's tokens, tensor parallel over two processes."""
    with engine(model, executor="mp", tp=2, check=False) as llm:
        return generate(llm)


def test_uni_generates_vllm_uni_tokens_and_serves_every_call(
    model: Path, vllm_uni: list[list[int]]
) -> None:
    with engine(model) as llm:  # one rank: the default is uni
        executor = model_executor(llm)
        assert type(executor).__name__ == "SdkExecutor"
        assert executor.sdk_executor.backend_name == "uni"
        assert generate(llm) == vllm_uni
        # LLM.collective_rpc: a callable gets vLLM's worker, a name runs its method.
        assert llm.collective_rpc(lambda worker: worker.rank) == [0]
        assert llm.collective_rpc("get_supported_tasks")[0] == executor.supported_tasks
        executor.check_health()
        assert executor.take_draft_token_ids() is None
        llm.sleep(level=1)
        assert executor.is_sleeping
        llm.wake_up()
        assert not executor.is_sleeping
        assert generate(llm) == vllm_uni  # still serving after sleep and wake-up


def test_mp_tp2_generates_vllm_mp_tokens(
    model: Path, vllm_mp: list[list[int]], vllm_uni: list[list[int]]
) -> None:
    with engine(model, tp=2) as llm:  # two ranks: the default is mp
        executor = model_executor(llm)
        assert executor.sdk_executor.backend_name == "mp"
        assert generate(llm) == vllm_mp
        pids = llm.collective_rpc(lambda worker: (worker.rank, os.getpid()))
        assert [rank for rank, _ in pids] == [0, 1]
        assert len({pid for _, pid in pids} | {os.getpid()}) == 3  # a process per rank
        executor.check_health()
    assert vllm_mp == vllm_uni  # tensor parallel changes nothing on this model


def test_ray_tp2_generates_vllm_mp_tokens(model: Path, vllm_mp: list[list[int]]) -> None:
    with engine(model, "ray", tp=2) as llm:
        assert model_executor(llm).sdk_executor.backend_name == "ray"
        assert generate(llm) == vllm_mp


def test_third_party_backend_generates_vllm_uni_tokens(
    model: Path, vllm_uni: list[list[int]]
) -> None:
    """examples/executor-threads: a backend vLLM has never heard of, found by name."""
    with engine(model, "threads") as llm:
        assert model_executor(llm).sdk_executor.backend_name == "threads"
        assert generate(llm) == vllm_uni


@pytest.mark.parametrize(
    ("backend", "options", "tp", "error", "expected"),
    [
        ("no-such-backend", None, 1, UnknownBackendError, "no-such-backend"),
        ("mp", {"no_such_option": 1}, 2, ConfigError, "no_such_option"),
        ("mp", {"start_method": "teleport"}, 2, ConfigError, "teleport"),
        ("uni", None, 2, ExecutorError, "runs at most 1 worker"),  # its capabilities
        # Ranks in the engine's process: the adapter's worker refuses before vLLM's is built.
        ("threads", None, 2, WorkerError, "a process per rank"),
    ],
)
def test_bad_settings_fail_before_any_worker_starts(
    model: Path,
    backend: str,
    options: dict[str, Any] | None,
    tp: int,
    error: type[Exception],
    expected: str,
) -> None:
    # The SDK refuses a config before its transport starts (the first four errors come from
    # there); engine() checks no process was left.
    with pytest.raises(error, match=expected), engine(model, backend, tp, options=options):
        pass


def test_a_dead_rank_fails_the_engine_naming_it_and_leaves_nothing(
    model: Path,
) -> None:
    with engine(model, "mp", tp=2) as llm:
        executor = model_executor(llm)
        called = threading.Event()
        executor.register_failure_callback(called.set)
        pids = dict(llm.collective_rpc(lambda worker: (worker.rank, os.getpid())))
        timer = threading.Timer(1.0, os.kill, (pids[1], signal.SIGKILL))
        timer.start()
        start = time.monotonic()
        with pytest.raises(WorkerDiedError) as caught:
            generate(llm, max_tokens=200)
        timer.join(10)
        assert caught.value.ranks == (1,) or 1 in caught.value.ranks
        assert "rank 1" in str(caught.value)
        assert called.wait(30), "the engine's failure callback was not called"
        assert time.monotonic() - start < 60
        with pytest.raises(Exception, match="rank 1"):
            executor.check_health()


def test_the_demo_runs_with_the_engine_core_in_its_own_process(
    model: Path, vllm_uni: list[list[int]], tmp_path: Path
) -> None:
    """``python -m executor_vllm`` (the README's command after its set-up), with vLLM's
    engine core in a process of its own, as by default: the qualname names the adapter in
    both processes, and the threads backend (a third party's) generates vLLM's tokens."""
    before = snapshot()
    env = {key: value for key, value in os.environ.items() if not key.startswith("VLLM_")}
    command = [sys.executable, "-m", "executor_vllm", "--backend", "threads", "--json"]
    command += ["--max-tokens", str(MAX_TOKENS)]
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["backend"] == "threads"
    assert report["tokens"] == vllm_uni
    assert report["start_s"] > 0
    assert report["generate_s"] > 0
    assert_nothing_left(before, None)
