#!/usr/bin/env python3
"""Check the SDK on a real GPU in one short run: ``python scripts/gpu_check.py``.

What it checks (docs/gpu.md has the details and the criteria):

* ``tokens``: the reference model greedy-decodes the same tokens on ``cuda`` as on ``cpu``
  (uni backend, the main job's model, seed and prompts); ``tokens_tp2``: the same with the mp
  backend at tp=2 on two GPUs.
* ``sleep_wake``: ``sleep`` frees the weights' and KV cache's device memory
  (``torch.cuda.mem_get_info`` read inside the worker) and ``wake_up`` brings it back, with
  the same tokens after.
* ``timing``: the per-step model time the reference worker reports agrees with the step's
  time measured around the call with ``torch.cuda.synchronize`` (the executor's share of a
  step is in [0, 1) and small for an in-process backend).
* ``device_per_thread_uni`` / ``_mp`` / ``_ray``: a call that runs on another thread than the
  one that set the worker up sees the worker's GPU as the current device.
* ``one_gpu_per_rank``: more ranks than GPUs is a ``ConfigError`` before any worker starts.
* ``fork_after_cuda``: the mp backend refuses ``start_method="fork"`` once CUDA is initialised
  in the driver (a ``ConfigError``).

Each check runs in a process of its own with its own time limit, and the whole run ends
within its budget (``--budget``), the stop of a check that overran included; a check that
overruns is stopped, with its workers, and fails. Without a GPU (or with ``--dry-run``) the
checks that can run on the CPU do, and the CUDA-only ones are listed as SKIP. Exit status: 0
when no check failed, 1 otherwise, 2 on bad usage.

Run it with the project's environment (``bash scripts/run.sh`` creates ``.venv``)::

    .venv/bin/python scripts/gpu_check.py --require-gpu --json gpu_check.json
    .venv/bin/python scripts/gpu_check.py --dry-run         # on a machine without a GPU

or, on a machine that reaches no package registry, from the offline bundle that
``scripts/gpu_bundle.py`` builds (it prints the command; docs/gpu.md has it too).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _gpu_procs import become_subreaper, clean_strays, run_limited
from _gpu_procs import tail as log_tail

try:
    # Needed at module level: the checks that must fail before a worker starts use a worker
    # class defined here, which spawned worker processes find by re-importing this file.
    from executor_core import WorkerBase
except ImportError as _exc:  # the script is run with a Python that lacks the SDK
    sys.exit(
        f"gpu_check: cannot import executor_core ({_exc}); run it with the project's "
        "environment: .venv/bin/python scripts/gpu_check.py (bash scripts/run.sh creates it), "
        "or with PYTHONPATH naming the folder the offline bundle was installed into "
        "(scripts/gpu_bundle.py prints the command)"
    )

if TYPE_CHECKING:
    from executor_core import ExecutorConfig
    from executor_reference import GenerationResult, ModelConfig, StepOutput

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"

#: Seconds the whole run may take by default: well inside the ten minutes a person with a
#: GPU (or a rented machine) gives it, with room for the stop-and-kill of a hung check.
DEFAULT_BUDGET_S = 420.0
#: A check is not started with less than this left of the budget (it could not finish).
MIN_CHECK_S = 15.0
#: Seconds a check that overran gets to shut its workers down after SIGTERM before the kill.
TERM_GRACE_S = 10.0
#: Seconds processes a finished check left behind get to exit by themselves (Ray's reaper
#: lets its processes linger a few seconds) before they are killed.
STRAY_GRACE_S = 8.0
#: Seconds of the budget kept back from every check's limit for stopping it if it overruns
#: (SIGTERM, the grace, the kill, then its strays): the whole run ends within the budget.
STOP_RESERVE_S = TERM_GRACE_S + STRAY_GRACE_S + 2.0
#: Why the Ray check says SKIP where Ray is missing, as on a machine set up from the offline
#: bundle (scripts/gpu_bundle.py), which does not carry Ray.
NO_RAY = "Ray is not installed (the offline GPU bundle leaves it out: too large to carry)"

#: Seconds a single collective call may take inside a check (a hang fails the call, not the run).
CALL_TIMEOUT_S = 60.0
#: Seconds torch.distributed may wait in a rendezvous or collective (NCCL / gloo).
DISTRIBUTED_TIMEOUT_S = 60.0
#: Seconds the mp and Ray backends may take to start their workers.
STARTUP_TIMEOUT_S = 60.0

#: A token difference counts as a rounding tie when the logits agreed this closely (max
#: absolute difference) up to it: fp32 kernels on a GPU and a CPU differ in the last bits.
TIE_MAX_LOGIT_DELTA = 1e-3
#: "Most of" the weights and KV cache: what sleep must free and wake_up take back.
MEMORY_FRACTION = 0.8
#: Largest median executor share of a step that the in-process backend may show. Its
#: overhead is a method call; a larger share means the worker stopped its clock before the
#: GPU finished (the kernels are asynchronous) and the rest of the step lands on the executor.
MAX_INPROCESS_SHARE = 0.25
#: A forbidden configuration is refused by a check of the config, at once: an error that
#: comes only after a wait (a start-up timeout) does not count.
MAX_REFUSAL_S = 10.0


# --- results ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    """What one check found: a status, a one-line summary with the figures, and the figures."""

    status: str
    summary: str
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Result:
    """One check's row in the report."""

    name: str
    status: str
    summary: str
    figures: dict[str, Any]
    seconds: float
    limit_s: float | None
    log_tail: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Env:
    """The machine as the probe saw it, and the mode the run chose."""

    gpu: bool
    gpu_count: int
    ray_installed: bool


# --- shared helpers (worker side: module-level so that calls can carry them) ------------------


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _memory_probe(worker: Any) -> dict[str, int]:
    """Runs on the worker: its memory_usage() and, on a GPU, the device-wide figures."""
    import torch

    usage: dict[str, int] = dict(worker.memory_usage())
    device = worker.state.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        usage["cuda_used"] = int(total - free)
        usage["cuda_total"] = int(total)
        usage["cuda_reserved"] = int(torch.cuda.memory_reserved(device))
        usage["cuda_allocated"] = int(torch.cuda.memory_allocated(device))
    return usage


def _thread_probe(worker: Any) -> dict[str, Any]:
    """Runs on the worker: which thread runs the call, and the device current on it."""
    import threading

    import torch

    thread = threading.current_thread()
    device = worker.state.device
    info: dict[str, Any] = {
        "rank": worker.rank,
        "thread": thread.name,
        "main_thread": thread is threading.main_thread(),
        "device": str(device),
        "pid": os.getpid(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    if device.type == "cuda":
        info["expected_device"] = device.index
        info["current_device"] = torch.cuda.current_device()
    return info


class IdleWorker(WorkerBase):
    """A worker that does nothing: for the checks whose configurations must be refused before
    a worker starts (if one starts anyway, it starts fast and touches no GPU)."""

    def execute_model(self, batch: Any) -> Any:
        return batch


# --- the checks (each runs in a child process) ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ChildContext:
    mode: str  # "gpu" or "cpu"
    workdir: Path

    @property
    def gpu(self) -> bool:
        return self.mode == "gpu"


def _main_job_defaults() -> argparse.Namespace:
    """``executor run``'s default options (model size, seed, prompts, batch): the tokens
    checks run exactly what the main job runs by default."""
    from executor_reference._main_job import add_run_arguments

    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    return parser.parse_args([])


def _model(size: str, seed: int) -> ModelConfig:
    import attrs

    from executor_reference import MODEL_SIZES

    return attrs.evolve(MODEL_SIZES[size], seed=seed)


def _config(
    checkpoint: Path,
    *,
    backend: str,
    device: str,
    tp: int = 1,
    kv_slots: int = 16,
    seed: int = 0,
    rpc_timeout: float | None = None,
) -> ExecutorConfig:
    """The main job's config (scripts/run.sh -> executor run), for the reference worker."""
    from executor_core import ExecutorConfig

    options: dict[str, Any] = {}
    if backend in ("mp", "ray"):
        options["startup_timeout"] = STARTUP_TIMEOUT_S
    return ExecutorConfig(
        backend=backend,
        worker_cls="executor_reference:ReferenceWorker",
        worker_kwargs={
            "checkpoint": str(checkpoint),
            "kv_slots": kv_slots,
            "seed": seed,
            "cpu_threads": 1,
            "distributed_timeout_s": DISTRIBUTED_TIMEOUT_S,
        },
        tensor_parallel_size=tp,
        device=device,
        rpc_timeout=rpc_timeout,
        backend_options=options,
    )


def _generate_main_job(
    ctx: ChildContext, *, backend: str, device: str, tp: int = 1
) -> GenerationResult:
    from executor_core import create_executor
    from executor_reference import ensure_checkpoint, generate, make_prompts

    job = _main_job_defaults()
    model = _model(job.model_size, job.seed)
    checkpoint = ensure_checkpoint(model, ctx.workdir)
    prompts = make_prompts(job.requests, job.prompt_len, model.vocab_size, job.seed)
    config = _config(
        checkpoint,
        backend=backend,
        device=device,
        tp=tp,
        kv_slots=job.batch_size * 2,  # as executor run sizes it at pp=1
        seed=job.seed,
    )
    with create_executor(config) as executor:
        return generate(
            executor,
            prompts,
            max_new_tokens=job.max_new_tokens,
            batch_size=job.batch_size,
            return_logits=True,
            timeout=CALL_TIMEOUT_S,
        )


def _compare_tokens(reference: GenerationResult, other: GenerationResult, label: str) -> Outcome:
    """Same tokens, or the first position where they differ and whether it is a rounding tie
    (the logits agreed up to there, and the reference's two best were closer than that)."""
    assert reference.logits is not None
    assert other.logits is not None
    first: tuple[int, int, int, int] | None = None  # prompt, position, reference, other token
    differing = 0
    max_delta = 0.0
    for p, (a, b) in enumerate(zip(reference.tokens, other.tokens, strict=True)):
        k = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        # Up to and including the first difference both ran on the same tokens, so their
        # logits are comparable; after it the sequences differ.
        upto = min(k + 1, len(a))
        delta = float((reference.logits[p][:upto] - other.logits[p][:upto]).abs().max())
        max_delta = max(max_delta, delta)
        if k < len(a):
            differing += 1
            if first is None or k < first[1]:
                first = (p, k, a[k], b[k])
    prompts, tokens = len(reference.tokens), len(reference.tokens[0])
    figures: dict[str, Any] = {
        "prompts": prompts,
        "tokens_per_prompt": tokens,
        "max_abs_logit_diff": max_delta,
        "differing_prompts": differing,
    }
    if first is None:
        return Outcome(
            PASS,
            f"{label}: {prompts} prompts x {tokens} tokens identical; "
            f"max |logit diff| {max_delta:.2e}",
            figures,
        )
    p, k, want, got = first
    top2 = reference.logits[p][k].topk(2).values
    gap = float(top2[0] - top2[1])
    figures.update(
        first_difference={"prompt": p, "position": k, "reference": want, "other": got},
        reference_top2_gap=gap,
    )
    where = (
        f"first difference at prompt {p} position {k} ({want} vs {got}), "
        f"{differing}/{prompts} prompts differ; top-2 logit gap there {gap:.2e}, "
        f"max |logit diff| up to it {max_delta:.2e}"
    )
    if max_delta <= TIE_MAX_LOGIT_DELTA and gap <= 2 * max_delta:
        return Outcome(PASS, f"{label}: a rounding tie: {where}", figures)
    return Outcome(FAIL, f"{label}: tokens differ: {where}", figures)


def check_tokens(ctx: ChildContext) -> Outcome:
    reference = _generate_main_job(ctx, backend="uni", device="cpu")
    if ctx.gpu:
        other = _generate_main_job(ctx, backend="uni", device="cuda")
        return _compare_tokens(reference, other, "uni cuda vs uni cpu")
    other = _generate_main_job(ctx, backend="mp", device="cpu", tp=2)
    return _compare_tokens(reference, other, "dry run: mp tp=2 cpu vs uni cpu")


def check_tokens_tp2(ctx: ChildContext) -> Outcome:
    reference = _generate_main_job(ctx, backend="uni", device="cpu")
    other = _generate_main_job(ctx, backend="mp", device="cuda", tp=2)
    return _compare_tokens(reference, other, "mp tp=2 cuda vs uni cpu")


def check_sleep_wake(ctx: ChildContext) -> Outcome:
    from executor_core import create_executor
    from executor_reference import ensure_checkpoint, generate, make_prompts

    # On a GPU a model whose weights and KV cache stand far above the allocator's granularity;
    # on the CPU the small one (the dry run must stay quick on two cores).
    model = _model("medium" if ctx.gpu else "small", 0)
    device = "cuda" if ctx.gpu else "cpu"
    checkpoint = ensure_checkpoint(model, ctx.workdir)
    prompts = make_prompts(4, 8, model.vocab_size, seed=1)
    config = _config(checkpoint, backend="uni", device=device, kv_slots=16)
    figures: dict[str, Any] = {"model_parameters": model.num_parameters, "device": device}
    problems: list[str] = []
    parts: list[str] = []
    held = 0
    same_tokens = True
    with create_executor(config) as executor:

        def tokens() -> list[list[int]]:
            return generate(executor, prompts, max_new_tokens=8, batch_size=4).tokens

        before = tokens()
        for level in (1, 2):
            awake: dict[str, int] = executor.collective_rpc(_memory_probe)[0]
            executor.sleep(level)
            asleep: dict[str, int] = executor.collective_rpc(_memory_probe)[0]
            executor.wake_up()
            woken: dict[str, int] = executor.collective_rpc(_memory_probe)[0]
            after = tokens()
            held = awake["weight_bytes"] + awake["kv_cache_bytes"]
            figures[f"level{level}"] = {"awake": awake, "asleep": asleep, "woken": woken}
            if asleep["weight_bytes"] or asleep["kv_cache_bytes"]:
                problems.append(f"level {level}: the worker still holds tensors while asleep")
            if woken["weight_bytes"] != awake["weight_bytes"]:
                problems.append(f"level {level}: wake_up did not restore every weight")
            if after != before:
                same_tokens = False
                problems.append(f"level {level}: different tokens after wake_up")
            if ctx.gpu:
                freed = awake["cuda_used"] - asleep["cuda_used"]
                retaken = woken["cuda_used"] - asleep["cuda_used"]
                parts.append(
                    f"sleep({level}) freed {_mib(freed)} of the device (mem_get_info), "
                    f"wake took {_mib(retaken)} back; reserved "
                    f"{_mib(awake['cuda_reserved'])} -> {_mib(asleep['cuda_reserved'])} -> "
                    f"{_mib(woken['cuda_reserved'])}"
                )
                if freed < MEMORY_FRACTION * held:
                    problems.append(
                        f"level {level}: sleep freed {_mib(freed)}, less than "
                        f"{MEMORY_FRACTION:.0%} of the {_mib(held)} of weights and KV cache"
                    )
                if retaken < MEMORY_FRACTION * held:
                    problems.append(
                        f"level {level}: wake_up took back {_mib(retaken)}, less than "
                        f"{MEMORY_FRACTION:.0%} of {_mib(held)}"
                    )
            else:
                # On the CPU the KV cache is mapped lazily (only its touched pages count in
                # the process's memory), so what must be freed is the weights.
                freed = awake["host_bytes"] - asleep["host_bytes"]
                parts.append(
                    f"sleep({level}) freed {_mib(freed)} of host memory (weights "
                    f"{_mib(awake['weight_bytes'])})"
                )
                if freed < MEMORY_FRACTION * awake["weight_bytes"]:
                    problems.append(
                        f"level {level}: sleep freed {_mib(freed)} of host memory, less than "
                        f"{MEMORY_FRACTION:.0%} of the {_mib(awake['weight_bytes'])} of weights"
                    )
        figures["weights_and_kv_bytes"] = held
    head = f"weights+KV {_mib(held)}; " + "; ".join(parts) + "; tokens after wake_up "
    head += "the same" if same_tokens else "DIFFER"
    if not ctx.gpu:
        head = "dry run (host memory): " + head
    if problems:
        return Outcome(FAIL, head + " -- " + "; ".join(problems), figures)
    return Outcome(PASS, head, figures)


def check_timing(ctx: ChildContext) -> Outcome:
    import torch

    from executor_core import create_executor
    from executor_reference import StepInput, ensure_checkpoint, generate, make_prompts

    if ctx.gpu:
        # Long prefills of a mid-size model: GPU work well above the kernel launches, so a
        # clock stopped before the GPU finished shows.
        model, batch, prompt_len, device = _model("medium", 0), 16, 448, "cuda"
    else:
        model, batch, prompt_len, device = _model("small", 0), 4, 64, "cpu"
    checkpoint = ensure_checkpoint(model, ctx.workdir)
    prompts = make_prompts(batch, prompt_len, model.vocab_size, seed=2)
    config = _config(checkpoint, backend="uni", device=device, kv_slots=batch)
    slots = tuple(range(batch))

    def sync() -> None:
        if ctx.gpu:
            torch.cuda.synchronize()

    with create_executor(config) as executor:

        def timed(step: StepInput) -> tuple[float, StepOutput]:
            sync()
            started = time.perf_counter()
            out: StepOutput = executor.execute_model(step)
            sync()
            return time.perf_counter() - started, out

        def run(prefills: int, decodes: int) -> tuple[list[float], list[float], list[float]]:
            prefill_shares, decode_shares, model_ms = [], [], []
            prefill = StepInput(batch_id=0, slots=slots, token_ids=prompts, start_pos=0)
            out: StepOutput | None = None
            for _ in range(prefills):
                wall, out = timed(prefill)
                prefill_shares.append(1.0 - out.model_time_s / wall)
                model_ms.append(out.model_time_s * 1e3)
            assert out is not None
            last = out.next_tokens
            for j in range(decodes):
                step = StepInput(
                    batch_id=0,
                    slots=slots,
                    token_ids=[[t] for t in last],
                    start_pos=prompt_len + j,
                )
                wall, out = timed(step)
                decode_shares.append(1.0 - out.model_time_s / wall)
                last = out.next_tokens
            return prefill_shares, decode_shares, model_ms

        run(3, 3)  # warm-up: kernel selection, allocator growth
        prefill_shares, decode_shares, prefill_model_ms = run(8, 16)
        job = generate(
            executor,
            make_prompts(batch, 16, model.vocab_size, seed=3),
            max_new_tokens=16,
            batch_size=batch,
            timeout=CALL_TIMEOUT_S,
        )
    shares = prefill_shares + decode_shares
    figures: dict[str, Any] = {
        "device": device,
        "batch": batch,
        "prompt_len": prompt_len,
        "prefill_executor_shares": prefill_shares,
        "decode_executor_shares": decode_shares,
        "prefill_model_ms": prefill_model_ms,
        "generate_executor_share": job.executor_share,
        "generate_model_share": job.model_share,
    }
    prefill_median = statistics.median(prefill_shares)
    decode_median = statistics.median(decode_shares)
    summary = (
        f"{'synchronized ' if ctx.gpu else ''}wall vs worker model_time_s: executor share "
        f"median {prefill_median:.1%} over {len(prefill_shares)} prefills "
        f"(model {statistics.median(prefill_model_ms):.2f} ms each), {decode_median:.1%} over "
        f"{len(decode_shares)} decodes; generate() reports executor {job.executor_share:.1%}, "
        f"model {job.model_share:.1%}"
    )
    if not ctx.gpu:
        summary = "dry run (cpu): " + summary
    problems: list[str] = []
    outside = [s for s in shares if not 0.0 <= s < 1.0]
    if outside:
        problems.append(f"{len(outside)} step(s) with a share outside [0, 1): {outside[:4]}")
    if not 0.0 <= job.executor_share < 1.0:
        problems.append(f"generate()'s executor share {job.executor_share} is outside [0, 1)")
    if prefill_median > MAX_INPROCESS_SHARE or decode_median > MAX_INPROCESS_SHARE:
        problems.append(
            f"an in-process backend's median share is above {MAX_INPROCESS_SHARE:.0%}: the "
            "worker's clock misses part of the step"
        )
    if problems:
        return Outcome(FAIL, summary + " -- " + "; ".join(problems), figures)
    return Outcome(PASS, summary, figures)


def _device_outcome(infos: list[dict[str, Any]], label: str, *, off_main: bool) -> Outcome:
    """PASS when every rank's call saw the rank's own device as current (on a GPU), or, on
    the CPU, reached the worker on the path that the GPU run takes."""
    problems: list[str] = []
    seen: list[str] = []
    for info in infos:
        if "current_device" in info:
            seen.append(
                f"rank {info['rank']} on thread {info['thread']!r}: current cuda:"
                f"{info['current_device']}, worker's {info['device']}"
            )
            if info["current_device"] != info["expected_device"]:
                problems.append(f"rank {info['rank']} saw the wrong device")
        else:
            seen.append(f"rank {info['rank']} on thread {info['thread']!r}: {info['device']}")
        if off_main and info["main_thread"]:
            problems.append(f"rank {info['rank']}: the call ran on the main thread, not a runner")
    ranks = [info["rank"] for info in infos]
    if ranks != list(range(len(infos))):
        problems.append(f"replies from ranks {ranks}")
    summary = f"{label}: " + "; ".join(seen)
    if problems:
        return Outcome(FAIL, summary + " -- " + "; ".join(problems), {"ranks": infos})
    return Outcome(PASS, summary, {"ranks": infos})


def _thread_infos(ctx: ChildContext, backend: str, device: str, tp: int) -> list[dict[str, Any]]:
    from executor_core import create_executor
    from executor_reference import ensure_checkpoint

    checkpoint = ensure_checkpoint(_model("small", 0), ctx.workdir)
    # A default timeout sends every call through the backend's call path (on uni: its runner
    # thread) instead of a plain method call on the caller's thread.
    config = _config(checkpoint, backend=backend, device=device, tp=tp, rpc_timeout=CALL_TIMEOUT_S)
    with create_executor(config) as executor:
        infos: list[dict[str, Any]] = executor.collective_rpc(_thread_probe)
        return infos


def check_device_per_thread_uni(ctx: ChildContext) -> Outcome:
    device = "cuda" if ctx.gpu else "cpu"
    outcome = _device_outcome(
        _thread_infos(ctx, "uni", device, 1),
        f"{'' if ctx.gpu else 'dry run: '}uni {device}, rpc_timeout set",
        off_main=True,
    )
    if ctx.gpu and _cuda_count() == 1:
        outcome.summary += " (one GPU: device 0 is every thread's default, so this proves the "
        outcome.summary += "call path only)"
    return outcome


def _cuda_count() -> int:
    import torch

    return int(torch.cuda.device_count())


def check_device_per_thread_mp(ctx: ChildContext) -> Outcome:
    if ctx.gpu:
        tp = 2 if _cuda_count() >= 2 else 1
        outcome = _device_outcome(
            _thread_infos(ctx, "mp", "cuda", tp), f"mp tp={tp} cuda", off_main=False
        )
        if tp == 1:
            outcome.summary += " (one GPU: proves the call path only)"
        return outcome
    return _device_outcome(
        _thread_infos(ctx, "mp", "cpu", 2), "dry run: mp tp=2 cpu", off_main=False
    )


def check_device_per_thread_ray(ctx: ChildContext) -> Outcome:
    try:
        import ray  # noqa: F401 - only asks whether Ray is installed
    except ImportError as exc:
        return Outcome(SKIP, f"{NO_RAY}: {exc}")
    from executor_core import create_executor
    from executor_reference import ensure_checkpoint

    device = "cuda" if ctx.gpu else "cpu"
    # On the CPU one actor: the dry run proves the path, and a second one costs seconds.
    tp = 2 if ctx.gpu and _cuda_count() >= 2 else 1
    checkpoint = ensure_checkpoint(_model("small", 0), ctx.workdir)
    config = _config(checkpoint, backend="ray", device=device, tp=tp, rpc_timeout=CALL_TIMEOUT_S)
    try:
        executor = create_executor(config)
    except Exception as exc:  # noqa: BLE001 - Ray that cannot start here is a SKIP, by design
        first_line = (str(exc).strip().splitlines() or [""])[0]
        return Outcome(SKIP, f"Ray did not start: {type(exc).__name__}: {first_line}")
    with executor:
        infos: list[dict[str, Any]] = executor.collective_rpc(_thread_probe)
    label = f"ray tp={tp} {device}" if ctx.gpu else f"dry run: ray tp={tp} cpu"
    return _device_outcome(infos, label, off_main=False)


@contextlib.contextmanager
def _counting_process_starts() -> Iterator[list[str]]:
    """Counts the processes multiprocessing starts meanwhile (the mp backend's workers)."""
    import multiprocessing.process

    started: list[str] = []
    original = multiprocessing.process.BaseProcess.start

    def start(self: multiprocessing.process.BaseProcess) -> None:
        started.append(self.name)
        original(self)

    setattr(multiprocessing.process.BaseProcess, "start", start)  # noqa: B010 - a patch
    try:
        yield started
    finally:
        setattr(multiprocessing.process.BaseProcess, "start", original)  # noqa: B010


def _expect_refusal(config: ExecutorConfig, label: str, word: str) -> Outcome:
    """PASS when create_executor raises ConfigError mentioning ``word`` at once, before a
    worker process starts."""
    from executor_core import ConfigError, create_executor

    with _counting_process_starts() as started:
        began = time.perf_counter()
        try:
            with create_executor(config) as executor:
                elapsed = time.perf_counter() - began
                executor.collective_rpc("check_health", timeout=CALL_TIMEOUT_S)
        except ConfigError as exc:
            elapsed = time.perf_counter() - began
            figures = {"error": str(exc), "seconds": elapsed, "processes_started": len(started)}
            said = f"{label}: ConfigError after {elapsed:.2f} s, {len(started)} worker(s) started"
            problems = []
            if word.lower() not in str(exc).lower():
                problems.append(f"the message does not mention {word!r}")
            if started:
                problems.append("worker processes were started first")
            if elapsed > MAX_REFUSAL_S:
                problems.append(f"it took more than {MAX_REFUSAL_S:.0f} s")
            if problems:
                return Outcome(FAIL, f"{said} -- {'; '.join(problems)}: {exc}", figures)
            return Outcome(PASS, f"{said}: {exc}", figures)
        except Exception as exc:  # noqa: BLE001 - any other error is this check's failure
            elapsed = time.perf_counter() - began
            return Outcome(
                FAIL,
                f"{label}: raised {type(exc).__name__}, not ConfigError, after {elapsed:.2f} s "
                f"and {len(started)} worker start(s): {str(exc).strip()[:300]}",
                {"error": str(exc), "seconds": elapsed, "processes_started": len(started)},
            )
    return Outcome(
        FAIL,
        f"{label}: no error; the executor started {len(started)} worker(s) in {elapsed:.2f} s",
        {"seconds": elapsed, "processes_started": len(started)},
    )


def check_one_gpu_per_rank(ctx: ChildContext) -> Outcome:
    from executor_core import ExecutorConfig

    count = _cuda_count()
    config = ExecutorConfig(
        backend="mp",
        worker_cls=IdleWorker,
        tensor_parallel_size=count + 1,
        device="cuda",
        backend_options={"startup_timeout": STARTUP_TIMEOUT_S},
    )
    return _expect_refusal(config, f"mp cuda tp={count + 1} on {count} GPU(s)", "GPU")


def check_fork_after_cuda(ctx: ChildContext) -> Outcome:
    import torch

    from executor_core import ExecutorConfig

    cuda: Any = torch.cuda  # init and is_initialized carry no type information
    cuda.init()
    if not cuda.is_initialized():
        return Outcome(FAIL, "torch.cuda.init() did not initialise CUDA in the driver")
    config = ExecutorConfig(
        backend="mp",
        worker_cls=IdleWorker,
        device="cuda",
        backend_options={"start_method": "fork", "startup_timeout": STARTUP_TIMEOUT_S},
    )
    return _expect_refusal(config, "mp start_method=fork after torch.cuda.init()", "fork")


def probe(ctx: ChildContext) -> Outcome:
    """The environment: versions, GPUs, installed backends."""
    import importlib.util

    import torch

    import executor_core
    from executor_core.backend import default_registry

    available = bool(torch.cuda.is_available())
    count = int(torch.cuda.device_count()) if available else 0
    gpus: list[dict[str, Any]] = []
    for index in range(count):
        props = torch.cuda.get_device_properties(index)
        gpus.append(
            {
                "name": props.name,
                "total_bytes": int(props.total_memory),
                "capability": f"{props.major}.{props.minor}",
            }
        )
    figures: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": available,
        "gpu_count": count,
        "gpus": gpus,
        "executor_core": executor_core.__version__,
        # Where the SDK was imported from: the bundle's folder on a machine set up offline.
        "executor_core_path": str(Path(executor_core.__file__).parent),
        "backends": sorted(spec.name for spec in default_registry().backends()),
        "ray_installed": importlib.util.find_spec("ray") is not None,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    if available:
        with contextlib.suppress(Exception):  # some builds have no NCCL
            nccl: Any = torch.cuda.nccl  # version() carries no type information
            figures["nccl"] = ".".join(str(v) for v in nccl.version())
    names = ", ".join(sorted({g["name"] for g in gpus})) or "no GPU"
    return Outcome(
        PASS,
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), {count} GPU(s): {names}; "
        f"Python {figures['python']}; executor_core {executor_core.__version__} from "
        f"{figures['executor_core_path']}; backends {', '.join(figures['backends'])}",
        figures,
    )


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    #: What it checks, for --list.
    title: str
    run: Callable[[ChildContext], Outcome]
    #: Seconds the check may take (its process is stopped after that).
    limit_s: float
    #: Why the check does not run on this machine, or None when it does.
    skip: Callable[[Env], str | None]


def _anywhere(_env: Env) -> str | None:
    return None


def _needs_gpu(env: Env) -> str | None:
    return None if env.gpu else "no GPU (dry run): needs CUDA"


def _needs_two_gpus(env: Env) -> str | None:
    if not env.gpu:
        return "no GPU (dry run): needs two CUDA devices"
    return None if env.gpu_count >= 2 else f"needs two GPUs, {env.gpu_count} visible"


def _needs_two_gpus_or_dry(env: Env) -> str | None:
    return _needs_two_gpus(env) if env.gpu else "no GPU (dry run): covered by tokens (mp tp=2 cpu)"


def _needs_ray(env: Env) -> str | None:
    return None if env.ray_installed else NO_RAY


PROBE = Check("probe", "the machine: versions, GPUs, backends", probe, 60.0, _anywhere)

#: In the order they run; fork_after_cuda last (it initialises CUDA in its driver).
CHECKS: tuple[Check, ...] = (
    Check("tokens", "same greedy tokens on cuda as on cpu (uni)", check_tokens, 90.0, _anywhere),
    Check(
        "tokens_tp2",
        "same greedy tokens with mp tp=2 on two GPUs as on cpu",
        check_tokens_tp2,
        90.0,
        _needs_two_gpus_or_dry,
    ),
    Check(
        "sleep_wake",
        "sleep frees the device memory, wake_up takes it back, same tokens",
        check_sleep_wake,
        75.0,
        _anywhere,
    ),
    Check(
        "timing",
        "the worker's model time agrees with the synchronized step time",
        check_timing,
        75.0,
        _anywhere,
    ),
    Check(
        "device_per_thread_uni",
        "uni: a call on the runner thread sees the worker's GPU",
        check_device_per_thread_uni,
        45.0,
        _anywhere,
    ),
    Check(
        "device_per_thread_mp",
        "mp: rank r's calls see GPU r",
        check_device_per_thread_mp,
        75.0,
        _anywhere,
    ),
    Check(
        "device_per_thread_ray",
        "ray: each actor's calls see its GPU",
        check_device_per_thread_ray,
        100.0,
        _needs_ray,
    ),
    Check(
        "one_gpu_per_rank",
        "more ranks than GPUs: ConfigError before any worker starts",
        check_one_gpu_per_rank,
        45.0,
        _anywhere,  # without a GPU: one rank on none, refused the same way
    ),
    Check(
        "fork_after_cuda",
        "mp refuses start_method=fork after CUDA is initialised in the driver",
        check_fork_after_cuda,
        45.0,
        _needs_gpu,
    ),
)

_BY_NAME = {check.name: check for check in (PROBE, *CHECKS)}


def _child_main(name: str, mode: str, workdir: Path, result_path: Path) -> int:
    """Run one check in this (child) process and write its outcome to ``result_path``."""

    def stop(_signum: int, _frame: object) -> None:
        # The parent's time limit: unwind, so that every executor's `with` shuts it down.
        raise KeyboardInterrupt(f"{name}: stopped at its time limit")

    signal.signal(signal.SIGTERM, stop)
    ctx = ChildContext(mode=mode, workdir=workdir)
    try:
        outcome = _BY_NAME[name].run(ctx)
    except Exception as exc:  # noqa: BLE001 - every error is the check's failure, reported
        traceback.print_exc()
        first_line = (str(exc).strip().splitlines() or [""])[0]
        outcome = Outcome(
            FAIL,
            f"{type(exc).__name__}: {first_line[:300]}",
            {"traceback": traceback.format_exc()},
        )
    result_path.write_text(json.dumps(dataclasses.asdict(outcome), default=str))
    return 0


# --- the parent: runs each check in a child with a time limit ---------------------------------


def _run_child(check: Check, mode: str, workdir: Path, limit_s: float, reaping: bool) -> Result:
    result_path = workdir / f"{check.name}.json"
    log_path = workdir / f"{check.name}.log"
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        check.name,
        "--mode",
        mode,
        "--workdir",
        str(workdir),
        "--result",
        str(result_path),
    ]
    finished = run_limited(
        command,
        log_path=log_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        limit_s=limit_s,
        term_grace_s=TERM_GRACE_S,
    )
    seconds, timed_out = finished.seconds, finished.timed_out
    killed = clean_strays(STRAY_GRACE_S) if reaping else 0
    tail = log_tail(log_path)
    if timed_out:
        result = Result(
            check.name,
            FAIL,
            f"did not finish within its {limit_s:g} s limit; stopped with its workers",
            {},
            seconds,
            limit_s,
            tail,
        )
    else:
        try:
            data = json.loads(result_path.read_text())
            result = Result(
                check.name,
                data["status"],
                data["summary"],
                data["figures"],
                seconds,
                limit_s,
                tail if data["status"] == FAIL else [],
            )
        except (OSError, ValueError, KeyError):
            result = Result(
                check.name,
                FAIL,
                f"its process exited with status {finished.returncode} and no result",
                {},
                seconds,
                limit_s,
                tail,
            )
    if killed:
        result.figures["stray_processes_killed"] = killed
        result.summary += f" [{killed} process(es) left behind were killed]"
    return result


def _print_result(result: Result) -> None:
    took = f"{result.seconds:6.1f} s" if result.status != SKIP or result.seconds else "       -"
    print(f"{result.status}  {result.name:<22} {took}  {result.summary}", flush=True)
    for line in result.log_tail:
        print(f"      | {line}", flush=True)


def _env_from_probe(result: Result, dry_run: bool) -> tuple[Env, str | None]:
    figures = result.figures
    count = int(figures.get("gpu_count", 0))
    visible = result.status == PASS and bool(figures.get("cuda_available")) and count > 0
    ray = bool(figures.get("ray_installed", False))
    if dry_run:
        return Env(False, 0, ray), "--dry-run"
    if result.status != PASS:
        return Env(False, 0, ray), "the probe failed"
    if not visible:
        return Env(False, 0, ray), "no GPU is visible to torch"
    return Env(True, count, ray), None


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Check the SDK on a GPU (or, with --dry-run or without one, on the CPU).",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="run only what the CPU can run; CUDA checks are SKIP (the default without a GPU)",
    )
    parser.add_argument(
        "--require-gpu",
        action="store_true",
        help="fail at once when no GPU is visible instead of falling back to the dry run",
    )
    parser.add_argument("--json", metavar="OUT", help="also write the results to this file")
    parser.add_argument(
        "--only", metavar="NAME", action="append", help="run only this check (repeatable)"
    )
    parser.add_argument("--list", action="store_true", help="list the checks and exit")
    parser.add_argument(
        "--budget",
        type=float,
        default=DEFAULT_BUDGET_S,
        help=f"seconds the whole run may take (default {DEFAULT_BUDGET_S:.0f})",
    )
    parser.add_argument(
        "--workdir", help="directory for checkpoints and logs (default: a temporary one)"
    )
    # Internal: how the parent starts one check in a child process.
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("gpu", "cpu"), default="cpu", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None and (
        args.child not in _BY_NAME or args.result is None or args.workdir is None
    ):
        parser.error("--child needs a check name, --workdir and --result")
    if args.only:
        unknown = [n for n in args.only if n not in {c.name for c in CHECKS}]
        if unknown:
            parser.error(f"unknown check(s) {unknown}; see --list")
    if args.budget <= 0:
        parser.error("--budget must be > 0")
    return args


@contextlib.contextmanager
def _workdir(path: str | None) -> Iterator[Path]:
    if path is not None:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        yield Path(tmp)


def _write_report(
    path: str,
    *,
    env: Env,
    dry_reason: str | None,
    budget_s: float,
    wall_s: float,
    probe_result: Result,
    results: Sequence[Result],
    exit_status: int | None,
) -> None:
    """Write the ``--json`` report. Written again after every check, so that a run cut short
    from outside (a machine taken back) leaves what it had found; ``complete`` is true only
    in the last one, with the summary and the exit status."""
    counts = {status: sum(r.status == status for r in results) for status in (PASS, FAIL, SKIP)}
    report = {
        "script": "scripts/gpu_check.py",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "mode": "gpu" if env.gpu else "dry-run",
        "dry_run_reason": dry_reason,
        "budget_s": budget_s,
        "wall_s": wall_s,
        "environment": probe_result.figures,
        "checks": [dataclasses.asdict(r) for r in results],
        "summary": counts,
        "exit_status": exit_status,
        "complete": exit_status is not None,
    }
    Path(path).write_text(json.dumps(report, indent=2, default=str) + "\n")


def _limit(check: Check, deadline: float) -> float:
    """The time ``check`` may take from now: its own limit, cut to what the budget has left
    once the time to stop it is kept back."""
    return min(check.limit_s, deadline - time.monotonic() - STOP_RESERVE_S)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.child is not None:
        return _child_main(args.child, args.mode, Path(args.workdir), Path(args.result))
    if args.list:
        for check in CHECKS:
            print(f"{check.name:<22} {check.limit_s:4.0f} s  {check.title}")
        return 0
    started = time.monotonic()
    deadline = started + args.budget
    reaping = become_subreaper()
    results: list[Result] = []
    with _workdir(args.workdir) as workdir:
        limit = _limit(PROBE, deadline)
        if limit < 1.0:
            probe_result = Result(
                PROBE.name,
                FAIL,
                f"not run: a {args.budget:g} s budget leaves no time once {STOP_RESERVE_S:g} s "
                "are kept for stopping a check",
                {},
                0.0,
                None,
            )
        else:
            probe_result = _run_child(PROBE, "cpu", workdir, limit, reaping)
        env, dry_reason = _env_from_probe(probe_result, args.dry_run)
        mode = "gpu" if env.gpu else "cpu"
        if env.gpu:
            print(f"gpu_check: GPU run, budget {args.budget:g} s", flush=True)
        else:
            print(
                f"gpu_check: dry run on the CPU ({dry_reason}), budget {args.budget:g} s",
                flush=True,
            )
        _print_result(probe_result)
        not_run: str | None = None
        if probe_result.status != PASS:
            results.append(probe_result)
            not_run = "not run: the probe failed"
        elif args.require_gpu and not env.gpu:
            results.append(
                Result("require_gpu", FAIL, f"--require-gpu, but {dry_reason}", {}, 0, None)
            )
            _print_result(results[-1])
            not_run = "not run: no GPU (--require-gpu)"
        for check in CHECKS:
            if args.only and check.name not in args.only:
                continue
            if args.json:
                _write_report(
                    args.json,
                    env=env,
                    dry_reason=dry_reason,
                    budget_s=args.budget,
                    wall_s=time.monotonic() - started,
                    probe_result=probe_result,
                    results=results,
                    exit_status=None,
                )
            reason = not_run or check.skip(env)
            limit = _limit(check, deadline)
            if reason is not None:
                result = Result(check.name, SKIP, reason, {}, 0.0, None)
            elif limit < MIN_CHECK_S:
                result = Result(
                    check.name,
                    FAIL,
                    f"not run: {max(0.0, limit):.0f} s of the {args.budget:g} s budget left "
                    f"(after {STOP_RESERVE_S:g} s kept for stopping it)",
                    {},
                    0.0,
                    None,
                )
            else:
                result = _run_child(check, mode, workdir, limit, reaping)
            results.append(result)
            _print_result(result)
    wall = time.monotonic() - started
    counts = {status: sum(r.status == status for r in results) for status in (PASS, FAIL, SKIP)}
    exit_status = 1 if counts[FAIL] or probe_result.status != PASS else 0
    print(
        f"summary: {counts[PASS]} PASS, {counts[FAIL]} FAIL, {counts[SKIP]} SKIP "
        f"({'GPU run' if env.gpu else 'dry run'}) in {wall:.1f} s; exit status {exit_status}",
        flush=True,
    )
    if args.json:
        _write_report(
            args.json,
            env=env,
            dry_reason=dry_reason,
            budget_s=args.budget,
            wall_s=wall,
            probe_result=probe_result,
            results=results,
            exit_status=exit_status,
        )
    return exit_status


if __name__ == "__main__":
    sys.exit(main())
