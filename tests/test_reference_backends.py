"""The reference model end to end on every installed backend: the same greedy tokens and
logits as one process, each rank reading only its shard, sleep/wake that frees memory."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from executor_core import Executor, ExecutorConfig, WorkerError, create_executor
from executor_core.backend import default_registry
from executor_reference import (
    MODEL_SIZES,
    GenerationResult,
    ensure_checkpoint,
    generate,
    make_prompts,
)
from executor_reference._checkpoint import (
    Split,
    checkpoint_layout,
    shard_range,
    stage_tensor_names,
)

INSTALLED = {spec.name for spec in default_registry().backends()}

#: 3.1M parameters (12.5 MB): a weight release stands well above allocator noise.
MODEL = MODEL_SIZES["small"]
PROMPTS = make_prompts(8, 8, MODEL.vocab_size, seed=1)
MAX_NEW_TOKENS = 6
BATCH_SIZE = 4
TIMEOUT_S = 120.0

#: (backend, tp, pp). mp tp2 x pp2 is left out: four worker processes on two cores would
#: take most of the suite's time budget for no path that tp2 and pp2 do not already cover.
LAYOUTS = [("uni", 1, 1), ("mp", 2, 1), ("mp", 1, 2), ("ray", 2, 1)]


def _layout_param(backend: str, tp: int, pp: int) -> Any:
    return pytest.param(
        (backend, tp, pp),
        id=f"{backend}-tp{tp}-pp{pp}",
        marks=pytest.mark.skipif(
            backend not in INSTALLED, reason=f"backend {backend!r} is not installed"
        ),
    )


def _config(checkpoint: Path, backend: str, tp: int = 1, pp: int = 1) -> ExecutorConfig:
    return ExecutorConfig(
        backend=backend,
        worker_cls="executor_reference:ReferenceWorker",
        worker_kwargs={"checkpoint": str(checkpoint), "kv_slots": 16, "cpu_threads": 1},
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        rpc_timeout=TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_checkpoint(MODEL, tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> GenerationResult:
    """uni, tp1, one step at a time: what every other layout must reproduce."""
    with create_executor(_config(checkpoint, "uni")) as executor:
        return generate(
            executor,
            PROMPTS,
            max_new_tokens=MAX_NEW_TOKENS,
            batch_size=BATCH_SIZE,
            max_concurrent_batches=1,
            return_logits=True,
        )


@pytest.fixture(scope="module", params=[_layout_param(*layout) for layout in LAYOUTS])
def executor(request: pytest.FixtureRequest, checkpoint: Path) -> Iterator[Executor]:
    backend, tp, pp = request.param
    with create_executor(_config(checkpoint, backend, tp, pp)) as started:
        yield started


def _assert_same_generation(result: GenerationResult, reference: GenerationResult) -> None:
    assert result.tokens == reference.tokens
    assert result.logits is not None
    assert reference.logits is not None
    for got, want in zip(result.logits, reference.logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _generate(executor: Executor, concurrency: int = 1, logits: bool = True) -> GenerationResult:
    return generate(
        executor,
        PROMPTS,
        max_new_tokens=MAX_NEW_TOKENS,
        batch_size=BATCH_SIZE,
        max_concurrent_batches=concurrency,
        return_logits=logits,
        timeout=TIMEOUT_S,
    )


@pytest.mark.slow  # builds a model on several workers: seconds each
def test_same_tokens_and_logits_as_one_process(
    executor: Executor, reference: GenerationResult
) -> None:
    _assert_same_generation(_generate(executor), reference)


@pytest.mark.slow  # builds a model on several workers: seconds each
def test_async_overlap_gives_the_same_tokens(
    executor: Executor, reference: GenerationResult
) -> None:
    concurrency = max(2, executor.max_concurrent_batches)
    result = _generate(executor, concurrency=concurrency)
    assert result.max_concurrent_batches == concurrency
    _assert_same_generation(result, reference)


@pytest.mark.slow  # builds a model on several workers: seconds each
def test_each_rank_loads_only_its_shard(executor: Executor, checkpoint: Path) -> None:
    config = executor.config
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    layout = checkpoint_layout(MODEL)
    full = load_file(str(checkpoint))
    shapes = executor.collective_rpc("loaded_shard")
    usage = executor.collective_rpc("memory_usage")
    weights = executor.collective_rpc("weights_state")
    for rank in range(config.world_size):
        pp_rank, tp_rank = divmod(rank, tp)
        names = stage_tensor_names(MODEL, pp, pp_rank)
        assert sorted(shapes[rank]) == sorted(names), f"rank {rank} read tensors of other stages"
        expected_bytes = 0
        for name in names:
            shape, split = layout[name]
            want = full[name]
            if split is Split.ROWS:
                want = want[slice(*shard_range(shape[0], tp_rank, tp))]
            elif split is Split.COLUMNS:
                want = want[:, slice(*shard_range(shape[1], tp_rank, tp))]
            assert shapes[rank][name] == tuple(want.shape), (rank, name)
            assert torch.equal(weights[rank][name], want), (rank, name)
            expected_bytes += want.numel() * want.element_size()
        assert usage[rank]["loaded_bytes"] == expected_bytes
    total = sum(t.numel() * t.element_size() for t in full.values())
    assert sum(u["loaded_bytes"] for u in usage) < total * 1.01  # nothing read twice...
    replicated = sum(
        full[n].numel() * 4 for n, (_s, split) in layout.items() if split is Split.REPLICATED
    )
    assert sum(u["loaded_bytes"] for u in usage) <= total + (tp - 1) * replicated  # ...but norms


def _memory(executor: Executor) -> list[dict[str, int]]:
    usage: list[dict[str, int]] = executor.collective_rpc("memory_usage")
    return usage


@pytest.mark.slow  # builds a model on several workers: seconds each
@pytest.mark.parametrize("level", [1, 2])
def test_sleep_releases_the_weights_and_wake_restores_the_outputs(
    executor: Executor, reference: GenerationResult, level: int
) -> None:
    awake = _memory(executor)
    executor.sleep(level)
    asleep = _memory(executor)
    executor.wake_up()
    woken = _memory(executor)
    for rank, (a, s, w) in enumerate(zip(awake, asleep, woken, strict=True)):
        assert s["weight_bytes"] == 0
        assert s["kv_cache_bytes"] == 0
        released = a["host_bytes"] - s["host_bytes"]
        assert released >= 0.8 * a["weight_bytes"], (rank, level, a, s)
        assert s["offloaded_bytes"] == (a["weight_bytes"] if level == 1 else 0)
        assert w["weight_bytes"] == a["weight_bytes"]
        assert w["kv_cache_bytes"] == a["kv_cache_bytes"]
        assert w["offloaded_bytes"] == 0
    _assert_same_generation(_generate(executor), reference)


@pytest.mark.slow  # builds a model on several workers: seconds each
@pytest.mark.parametrize("level", [1, 2])
def test_wake_up_one_tag_at_a_time(
    executor: Executor, reference: GenerationResult, level: int
) -> None:
    first, second = ("weights", "kv_cache") if level == 1 else ("kv_cache", "weights")
    executor.sleep(level)
    executor.wake_up([first])
    half = _memory(executor)
    assert executor.sleeping_tags == {second}
    for usage in half:
        assert (usage["weight_bytes"] > 0) == (first == "weights")
        assert (usage["kv_cache_bytes"] > 0) == (first == "kv_cache")
    with pytest.raises(WorkerError, match=f"asleep \\({second}\\)"):
        _generate(executor, logits=False)
    executor.wake_up([second])
    assert not executor.is_sleeping
    _assert_same_generation(_generate(executor), reference)


# --- torchrun: the external_launcher backend -------------------------------------------------

_TORCHRUN_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from executor_core import ExecutorConfig, create_executor
    from executor_reference import generate

    checkpoint, out, tp, pp, prompts = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:5]), \\
        json.loads(sys.argv[5])
    config = ExecutorConfig(
        backend="external_launcher", tensor_parallel_size=tp, pipeline_parallel_size=pp,
        worker_cls="executor_reference:ReferenceWorker", rpc_timeout=120,
        worker_kwargs={"checkpoint": checkpoint, "kv_slots": 16, "cpu_threads": 1},
    )
    with create_executor(config) as executor:
        overlap = generate(executor, prompts, max_new_tokens=int(sys.argv[6]), batch_size=4,
                           max_concurrent_batches=2)
        result = generate(executor, prompts, max_new_tokens=int(sys.argv[6]), batch_size=4,
                          max_concurrent_batches=1, return_logits=True)
        shard = executor.collective_rpc("loaded_shard")[0]
    torch.save({"tokens": result.tokens, "overlap_tokens": overlap.tokens,
                "logits": result.logits, "shard": shard}, f"{out}.{os.environ['RANK']}")
    """
)


def _torchrun(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=cwd,
        # torchrun keeps a torchelastic_* log directory in the temp dir and never removes it.
        env={**os.environ, "TMPDIR": str(cwd)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.slow  # builds a model on several workers: seconds each
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_external_launcher_under_torchrun_matches_one_process(
    tmp_path: Path, checkpoint: Path, reference: GenerationResult, tp: int, pp: int
) -> None:
    script = tmp_path / "spmd.py"
    script.write_text(_TORCHRUN_SCRIPT)
    out = tmp_path / "out"
    _torchrun(
        str(script),
        str(checkpoint),
        str(out),
        str(tp),
        str(pp),
        json.dumps(PROMPTS),
        str(MAX_NEW_TOKENS),
        cwd=tmp_path,
    )
    for rank in range(2):
        got = torch.load(f"{out}.{rank}", weights_only=False)
        # SPMD: every rank's driver loop saw the same outputs.
        assert got["tokens"] == got["overlap_tokens"] == reference.tokens
        for mine, want in zip(got["logits"], reference.logits or [], strict=True):
            torch.testing.assert_close(mine, want, rtol=1e-4, atol=1e-4)
        names = stage_tensor_names(MODEL, pp, rank // tp)
        assert sorted(got["shard"]) == sorted(names)
        if tp == 2:
            assert got["shard"]["layers.0.attn.q_proj.weight"] == (
                MODEL.hidden_size // 2,
                MODEL.hidden_size,
            )


def test_external_launcher_outside_torchrun_says_how_to_start_it(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    from executor_core import ExecutorError

    with pytest.raises(ExecutorError, match=r"torchrun --nproc-per-node 2 script\.py"):
        create_executor(_config(checkpoint, "external_launcher", tp=2))


# --- the main job on every backend -----------------------------------------------------------

_CLI_ARGS = [
    "--model-size",
    "tiny",
    "--requests",
    "6",
    "--prompt-len",
    "5",
    "--max-new-tokens",
    "4",
    "--batch-size",
    "3",
    "--no-progress",
]


def _run_cli(tmp_path: Path, name: str, *args: str, torchrun: bool = False) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    argv = ["-m", "executor_core._cli", "run", *_CLI_ARGS, *args, "--output-json", str(out)]
    if torchrun:
        proc = _torchrun(*argv, cwd=tmp_path)
    else:
        proc = subprocess.run(
            [sys.executable, *argv],
            capture_output=True,
            text=True,
            timeout=180,
            cwd=tmp_path,
            env={**os.environ, "PYTHONWARNINGS": "error"},
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
    for line in ("tokens/s", "step latency: p50", "time split: executor"):
        assert line in proc.stdout, proc.stdout
    data: dict[str, Any] = json.loads(out.read_text())
    return data


#: ``executor run`` without a fault. mp (tp 2; pp 2 with --async-overlap) and ray (tp 2) run
#: in RECOVERY_RUNS instead: the same job and config, plus a recovery policy and a kill at
#: step 3, must give these same tokens; their runs without a policy are
#: test_same_tokens_and_logits_as_one_process's (the same generate(), on the same layouts).
CLI_RUNS = [
    ("external_launcher", ["--tp", "2"]),
]


@pytest.fixture(scope="module")
def cli_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run_cli(tmp_path_factory.mktemp("cli"), "uni", "--backend", "uni")


def test_main_job_runs_on_uni(cli_reference: dict[str, Any]) -> None:
    summary = cli_reference["summary"]
    assert summary["backend"] == "uni"
    assert summary["generated_tokens"] == 6 * 4
    assert summary["tokens_per_s"] > 0
    assert summary["step_latency_p50_ms"] <= summary["step_latency_p99_ms"]
    assert 0 <= summary["executor_share"] < 1


@pytest.mark.slow  # builds a model on several workers: seconds each
@pytest.mark.parametrize(
    ("backend", "args"),
    [
        pytest.param(
            b,
            a,
            id=f"{b}{''.join(a)}",
            marks=pytest.mark.skipif(b not in INSTALLED, reason=f"backend {b!r} not installed"),
        )
        for b, a in CLI_RUNS
    ],
)
def test_main_job_gives_the_same_tokens_on_every_backend(
    tmp_path: Path, cli_reference: dict[str, Any], backend: str, args: list[str]
) -> None:
    data = _run_cli(
        tmp_path, backend, "--backend", backend, *args, torchrun=backend == "external_launcher"
    )
    assert data["summary"]["backend"] == backend
    assert data["tokens"] == cli_reference["tokens"]


@pytest.mark.slow  # builds a model on several workers: seconds each
def test_every_rank_reports_its_step_times(executor: Executor) -> None:
    """Each rank times each step it runs; generate() takes them all to account for the
    executor's share (see test_reference_model for the accounting itself)."""
    from executor_reference import StepInput

    executor.collective_rpc("take_step_times")
    step = StepInput(batch_id=7, slots=[0], token_ids=[PROMPTS[0]], start_pos=0)
    executor.execute_model(step)
    times = executor.collective_rpc("take_step_times")
    config = executor.config
    assert sorted((t["pp_rank"], t["tp_rank"]) for t in times) == sorted(
        (pp, tp)
        for pp in range(config.pipeline_parallel_size)
        for tp in range(config.tensor_parallel_size)
    )
    for rank_times in times:
        [(batch_id, start_pos, started, ended)] = rank_times["steps"]
        assert (batch_id, start_pos) == (7, 0)
        assert started <= ended
    result = _generate(executor, logits=False)
    assert all(not t["steps"] for t in executor.collective_rpc("take_step_times"))
    for record in result.steps:
        # One batch in flight: the executor's and the model's parts of a step do not overlap.
        assert record.executor_time_s >= 0
        assert record.executor_time_s + record.model_time_s <= record.latency_s + 1e-6


@pytest.mark.slow  # builds a model on several workers: seconds each
@pytest.mark.skipif("mp" not in INSTALLED, reason="backend 'mp' not installed")
def test_main_job_across_three_nodes_gives_the_same_tokens(
    tmp_path: Path, cli_reference: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``executor run --backend mp`` with two node agents, one pipeline stage per node, and
    the rank of the last node killed mid-run: its agent starts it again (a rank
    replacement), the others keep theirs, and the tokens are those of a run without a
    fault."""
    from executor_core.backend import find_free_port

    monkeypatch.setenv("EXECUTOR_CHANNEL_SECRET", secrets.token_hex(32))
    port = find_free_port("127.0.0.2")
    # The driver listens on 127.0.0.2, not the default 127.0.0.1: the agents find it there.
    agent_cmd = [
        sys.executable,
        "-m",
        "executor_core",
        "node",
        "--master-addr",
        "127.0.0.2",
        "--master-port",
        str(port),
    ]
    agents = [
        subprocess.Popen([*agent_cmd, "--node-rank", str(rank), "--join-timeout", "120"])
        for rank in (1, 2)
    ]
    try:
        data = _run_cli(
            tmp_path,
            "mp-3-nodes",
            "--backend",
            "mp",
            "--pp",
            "3",
            "--num-nodes",
            "3",
            "--distributed-host",
            "127.0.0.2",
            "--backend-option",
            f"node_port={port}",
            "--recover",
            "--kill-rank",
            "2",
            "--kill-at-step",
            "3",
        )
        assert data["summary"]["restarted_ranks"] == [[2]]
        assert data["tokens"] == cli_reference["tokens"]
        assert [agent.wait(10) for agent in agents] == [0, 0]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait(10)


#: ``executor run --recover`` with a fault, on each backend that recovers (the tokens of a
#: run without one too: see CLI_RUNS).
RECOVERY_RUNS = [
    ("mp", ["--tp", "2"]),
    ("mp", ["--pp", "2", "--async-overlap"]),
    ("ray", ["--tp", "2"]),
]


@pytest.mark.slow  # builds a model on several workers, twice: seconds each
@pytest.mark.parametrize(
    ("backend", "args"),
    [
        pytest.param(
            b,
            a,
            id=f"{b}{''.join(a)}",
            marks=pytest.mark.skipif(b not in INSTALLED, reason=f"backend {b!r} not installed"),
        )
        for b, a in RECOVERY_RUNS
    ],
)
def test_main_job_recovers_from_a_killed_rank_with_the_same_tokens(
    tmp_path: Path, cli_reference: dict[str, Any], backend: str, args: list[str]
) -> None:
    """``executor run --recover --kill-rank 1 --kill-at-step 3``: the step in flight fails,
    the dead rank alone is replaced (the backends declare it), the batches in flight are
    replayed, and the tokens are those of the run without a fault (greedy decoding)."""
    data = _run_cli(
        tmp_path,
        f"{backend}-recovered",
        "--backend",
        backend,
        *args,
        "--recover",
        "--kill-rank",
        "1",
        "--kill-at-step",
        "3",
    )
    summary = data["summary"]
    assert summary["backend"] == backend
    assert summary["recoveries"] == 1
    assert summary["lost_ranks"] == [[1]]
    assert summary["restarted_ranks"] == [[1]], "only the dead rank got a new process"
    assert 0 < summary["recovery_s"][0] < 60
    assert data["tokens"] == cli_reference["tokens"]
    # The time split adds up after a recovery (issue 48: a survivor's times hold the steps
    # it ran before the death too, and the replayed steps must not take those).
    shares = summary["executor_share"] + summary["model_share"]
    assert 0 < shares <= 1.0 + 1e-9, summary


def test_main_job_refuses_half_a_fault(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "executor_core._cli", "run", "--kill-rank", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "give --kill-rank and --kill-at-step together" in proc.stderr
