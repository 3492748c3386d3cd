"""The reference model on one rank: checkpoint, shards, KV cache, the generation loop."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from safetensors.torch import load_file

from executor_core import ConfigError, Executor, ExecutorConfig, WorkerError, create_executor
from executor_reference import (
    MODEL_SIZES,
    GenerationResult,
    ModelConfig,
    StepInput,
    ensure_checkpoint,
    generate,
    make_prompts,
)
from executor_reference._checkpoint import (
    Split,
    checkpoint_layout,
    create_checkpoint,
    load_shard,
    read_config,
    stage_tensor_names,
)
from executor_reference._config import stage_layers
from executor_reference._step_timing import StepRecord

TINY = MODEL_SIZES["tiny"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_checkpoint(TINY, tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def uni(checkpoint: Path) -> Iterator[Executor]:
    config = ExecutorConfig(
        backend="uni",
        worker_cls="executor_reference:ReferenceWorker",
        worker_kwargs={"checkpoint": str(checkpoint), "kv_slots": 16, "cpu_threads": 1},
        rpc_timeout=60,
    )
    with create_executor(config) as executor:
        yield executor


def test_checkpoint_is_a_function_of_the_config(tmp_path: Path, checkpoint: Path) -> None:
    again = create_checkpoint(TINY, tmp_path / "again.safetensors")
    first, second = load_file(str(checkpoint)), load_file(str(again))
    assert first.keys() == second.keys() == checkpoint_layout(TINY).keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    other = load_file(str(create_checkpoint(attrs.evolve(TINY, seed=1), tmp_path / "o")))
    assert not torch.equal(first["embed.weight"], other["embed.weight"])
    assert read_config(again) == TINY
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_ensure_checkpoint_reuses_an_existing_file(checkpoint: Path) -> None:
    mtime = checkpoint.stat().st_mtime_ns
    assert ensure_checkpoint(TINY, checkpoint.parent) == checkpoint
    assert checkpoint.stat().st_mtime_ns == mtime


def test_read_config_rejects_a_foreign_file(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "foreign.safetensors"
    save_file({"x": torch.zeros(1)}, str(path))
    with pytest.raises(ValueError, match="not a reference-model checkpoint"):
        read_config(path)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shards_tile_each_tensor_exactly(checkpoint: Path, tp: int) -> None:
    full = load_file(str(checkpoint))
    names = list(full)
    shards = [load_shard(checkpoint, TINY, names, tp_rank=r, tp_size=tp) for r in range(tp)]
    for name, (shape, split) in checkpoint_layout(TINY).items():
        parts = [s[name] for s in shards]
        if split is Split.REPLICATED:
            assert all(torch.equal(p, full[name]) for p in parts)
            continue
        dim = 0 if split is Split.ROWS else 1
        assert all(p.shape[dim] == shape[dim] // tp for p in parts), name
        assert torch.equal(torch.cat(parts, dim=dim), full[name]), name


def test_pipeline_stages_partition_the_layers_and_tensors() -> None:
    for layers, pp in [(4, 2), (5, 2), (7, 3), (4, 4)]:
        ranges = [stage_layers(layers, pp, r) for r in range(pp)]
        assert [i for r in ranges for i in r] == list(range(layers))
        assert max(len(r) for r in ranges) - min(len(r) for r in ranges) <= 1
    names = [stage_tensor_names(TINY, 2, r) for r in range(2)]
    assert sorted(names[0] + names[1]) == sorted(checkpoint_layout(TINY))
    assert "embed.weight" in names[0]
    assert "lm_head.weight" in names[1]
    assert not set(names[0]) & set(names[1])


def test_parallel_sizes_that_do_not_divide_the_model_are_rejected() -> None:
    with pytest.raises(ConfigError, match="must divide the model's num_heads=4"):
        TINY.check_parallel(3, 1)
    with pytest.raises(ConfigError, match="at most the model's num_layers=4"):
        TINY.check_parallel(1, 5)
    with pytest.raises(ConfigError, match="multiple of num_heads"):
        ModelConfig(hidden_size=66, num_heads=4)


def test_decoding_with_the_kv_cache_matches_a_full_recompute(uni: Executor) -> None:
    prompts = make_prompts(4, 7, TINY.vocab_size, seed=5)
    result = generate(uni, prompts, max_new_tokens=6, batch_size=4, return_logits=True)
    assert result.logits is not None
    # Recompute the last position from scratch (one prefill over prompt + generated tokens)
    # in fresh slots: it must agree with what the cache-based decode steps produced.
    full = [p + t[:-1] for p, t in zip(prompts, result.tokens, strict=True)]
    step = StepInput(
        batch_id=99, slots=[8, 9, 10, 11], token_ids=full, start_pos=0, return_logits=True
    )
    out = uni.execute_model(step)
    assert list(out.next_tokens) == [t[-1] for t in result.tokens]
    torch.testing.assert_close(
        out.logits, torch.stack([lg[-1] for lg in result.logits]), rtol=1e-4, atol=1e-4
    )


def test_async_overlap_gives_the_same_tokens(uni: Executor) -> None:
    prompts = make_prompts(12, 5, TINY.vocab_size, seed=2)
    serial = generate(uni, prompts, max_new_tokens=5, batch_size=4, max_concurrent_batches=1)
    overlapped = generate(uni, prompts, max_new_tokens=5, batch_size=4, max_concurrent_batches=2)
    assert overlapped.max_concurrent_batches == 2
    assert overlapped.tokens == serial.tokens
    assert len(serial.steps) == len(overlapped.steps) == 3 * 5


def test_shares_are_of_each_steps_own_time_when_steps_overlap() -> None:
    def step(batch_id: int, submitted: float, done: float, executor_s: float) -> StepRecord:
        return StepRecord(
            batch_id=batch_id,
            prefill=False,
            tokens=1,
            submitted_at=submitted,
            done_at=done,
            model_time_s=(done - submitted) - executor_s,
            executor_time_s=executor_s,
        )

    # Two batches in flight: two 1 s steps overlap in 1.5 s of wall time, each with 0.1 s of
    # executor time: 10% of each step's time, 0.2 executor seconds in 1.5 wall seconds.
    result = GenerationResult(
        tokens=[[1], [2]],
        logits=None,
        steps=[step(0, 0.0, 1.0, 0.1), step(1, 0.5, 1.5, 0.1)],
        wall_time_s=1.5,
        max_concurrent_batches=2,
    )
    assert result.step_time_s == pytest.approx(2.0)
    assert result.executor_share == pytest.approx(0.1)
    assert result.model_share == pytest.approx(0.9)
    assert result.executor_time_per_wall_s == pytest.approx(0.2 / 1.5)


def test_prompts_of_different_lengths_are_batched_by_length(uni: Executor) -> None:
    prompts = make_prompts(3, 4, TINY.vocab_size, seed=8) + make_prompts(2, 9, 256, seed=9)
    mixed = generate(uni, prompts, max_new_tokens=3, batch_size=8)
    alone = [generate(uni, [p], max_new_tokens=3).tokens[0] for p in prompts]
    assert mixed.tokens == alone
    assert mixed.generated_tokens == 15
    assert mixed.tokens_per_s > 0
    assert 0 <= mixed.executor_share < 1
    assert mixed.latency_percentile(50) <= mixed.latency_percentile(99)


def test_generate_rejects_what_the_workers_cannot_hold(uni: Executor) -> None:
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len=96"):
        generate(uni, make_prompts(1, 90, 256), max_new_tokens=10)
    with pytest.raises(ValueError, match="need 32 KV-cache slots but the workers have kv_slots"):
        generate(
            uni, make_prompts(64, 3, 256), max_new_tokens=2, batch_size=16, max_concurrent_batches=2
        )
    with pytest.raises(ValueError, match="at least one token"):
        generate(uni, [[]], max_new_tokens=1)


def test_worker_rejects_bad_steps_and_stays_usable(uni: Executor) -> None:
    with pytest.raises(WorkerError, match="takes a StepInput"):
        uni.execute_model([1, 2, 3])
    with pytest.raises(WorkerError, match="outside the KV cache"):
        uni.execute_model(StepInput(batch_id=0, slots=[99], token_ids=[[1]], start_pos=0))
    with pytest.raises(WorkerError, match="same number"):
        uni.execute_model(StepInput(batch_id=0, slots=[0, 1], token_ids=[[1], [1, 2]], start_pos=0))
    assert generate(uni, [[1, 2, 3]], max_new_tokens=2).generated_tokens == 2


def test_asleep_worker_refuses_to_run_until_woken(uni: Executor) -> None:
    prompts = make_prompts(2, 4, TINY.vocab_size, seed=1)
    before = generate(uni, prompts, max_new_tokens=3).tokens
    uni.sleep(1)
    try:
        with pytest.raises(WorkerError, match="asleep"):
            generate(uni, prompts, max_new_tokens=3)
    finally:
        uni.wake_up()
    assert generate(uni, prompts, max_new_tokens=3).tokens == before


def test_missing_checkpoint_fails_executor_start(tmp_path: Path) -> None:
    config = ExecutorConfig(
        backend="uni",
        worker_cls="executor_reference:ReferenceWorker",
        worker_kwargs={"checkpoint": str(tmp_path / "nope.safetensors")},
    )
    with pytest.raises(WorkerError, match="does not exist"):
        create_executor(config)


def test_main_job_explains_bad_options(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from executor_core._cli import main

    assert main(["run", "--model-size", "tiny", "--tp", "3", "--no-progress"]) == 1
    assert "must divide the model's num_heads=4" in capsys.readouterr().err
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    argv = ["run", "--model-size", "tiny", "--backend", "external_launcher", "--tp", "2"]
    assert main(argv) == 1
    assert "torchrun --nproc-per-node 2" in capsys.readouterr().err
    assert main(["run", "--model-size", "tiny", "--prompt-len", "95"]) == 1
    assert "exceeds the model's max_seq_len=96" in capsys.readouterr().err


def _timed_step(submitted: float, done: float, started: float, finished: float) -> Any:
    from executor_reference._step import StepOutput

    step = StepInput(batch_id=0, slots=[0], token_ids=[[1]], start_pos=0)
    output = StepOutput(
        batch_id=0,
        next_tokens=(1,),
        logits=None,
        model_time_s=finished - started,
        started_at=started,
        finished_at=finished,
    )
    return step, output, submitted, done


def test_executor_time_counts_only_delays_on_the_steps_path() -> None:
    from executor_reference._step_timing import step_records

    # pp2: stage 0 starts 0.5 ms after submit and computes until 20.0; stage 1 (the output
    # rank) starts 3 ms late, but stage 0 is still computing then: only 0.5 ms in + 1 ms back.
    step = _timed_step(submitted=10.0, done=31.0, started=13.0, finished=30.0)
    pp_times = [
        {"pp_rank": 0, "tp_rank": 0, "steps": [(0, 0, 10.5, 20.0)]},
        {"pp_rank": 1, "tp_rank": 0, "steps": [(0, 0, 13.0, 30.0)]},
    ]
    [record] = step_records([step], pp_times)
    assert record.executor_time_s == pytest.approx(0.5 + 1.0)
    assert record.model_time_s == pytest.approx(30.0 - 13.0)  # the late start was no wait

    # The same, but stage 1 starts 2 ms after stage 0 finished: those 2 ms are the executor's.
    late_stage = _timed_step(submitted=10.0, done=31.0, started=22.0, finished=30.0)
    pp_times[1] = {"pp_rank": 1, "tp_rank": 0, "steps": [(0, 0, 22.0, 30.0)]}
    [record] = step_records([late_stage], pp_times)
    assert record.executor_time_s == pytest.approx(2.0 + 1.0)

    # tp2: the latest rank gates the first all-reduce, whichever rank returns the output.
    tp_step = _timed_step(submitted=10.0, done=20.5, started=10.1, finished=20.0)
    tp_times = [
        {"pp_rank": 0, "tp_rank": 0, "steps": [(0, 0, 10.1, 20.0)]},
        {"pp_rank": 0, "tp_rank": 1, "steps": [(0, 0, 10.7, 20.0)]},
    ]
    [record] = step_records([tp_step], tp_times)
    assert record.executor_time_s == pytest.approx(0.7 + 0.5)
    # Rank 0 (the output rank) spent 10.1..10.7 waiting for rank 1: not model time too.
    assert record.model_time_s == pytest.approx(9.9 - 0.6)
    assert record.model_time_s + record.executor_time_s <= record.latency_s + 1e-9

    # A rank busy with its previous step until 12.0 could not start before then.
    busy_times = [{"pp_rank": 0, "tp_rank": 0, "steps": [(5, 3, 9.0, 12.0), (0, 0, 12.2, 20.0)]}]
    [record] = step_records([tp_step], busy_times)
    assert record.executor_time_s == pytest.approx(0.2 + 0.5)

    # No rank kept times for the step: fall back to the output rank's own start.
    [record] = step_records([tp_step], [{"pp_rank": 0, "tp_rank": 0, "steps": []}])
    assert record.executor_time_s == pytest.approx(0.1 + 0.5)


def test_a_step_run_twice_takes_the_ranks_run_of_its_own_time() -> None:
    """After a recovery a step runs again (same batch and position): a survivor's times hold
    both runs, and each record takes the run that started while it was in flight, so the
    executor's and the model's shares still add up to at most the step's time (issue 48)."""
    from executor_reference._step_timing import step_records

    first = _timed_step(submitted=10.0, done=10.6, started=10.1, finished=10.5)
    again = _timed_step(submitted=20.0, done=22.7, started=22.2, finished=22.6)
    survivor = {"pp_rank": 0, "tp_rank": 0, "steps": [(0, 0, 10.1, 10.5), (0, 0, 22.2, 22.6)]}
    replaced = {"pp_rank": 0, "tp_rank": 1, "steps": [(0, 0, 22.1, 22.6)]}
    records = step_records([first, again], [survivor, replaced])
    assert [r.executor_time_s for r in records] == pytest.approx([0.1 + 0.1, 2.2 + 0.1])
    for record in records:
        assert record.model_time_s + record.executor_time_s <= record.latency_s + 1e-9
