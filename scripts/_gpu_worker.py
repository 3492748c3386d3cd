"""The checks of scripts/gpu_check.py on what the reference worker's GPU work costs:
``sleep_wake`` (sleep frees the weights' and KV cache's device memory, wake_up takes it back)
and ``timing`` (the worker's step clock counts the GPU's asynchronous work)."""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

from _gpu_common import (
    CALL_TIMEOUT_S,
    Context,
    Outcome,
    judge,
    mib,
    reference_config,
    reference_model,
)

if TYPE_CHECKING:
    from executor_reference import StepInput, StepOutput

#: "Most of" the weights and KV cache: what sleep must free and wake_up take back.
MEMORY_FRACTION = 0.8
#: Largest median executor share of a step that the in-process backend may show. Its
#: overhead is a method call; a larger share means the worker stopped its clock before the
#: GPU finished (the kernels are asynchronous) and the rest of the step lands on the executor.
MAX_INPROCESS_SHARE = 0.25


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


def check_sleep_wake(ctx: Context) -> Outcome:
    from executor_core import create_executor
    from executor_reference import generate, make_prompts

    # On a GPU a model whose weights and KV cache stand far above the allocator's granularity;
    # on the CPU the small one (the dry run must stay quick on two cores).
    model = reference_model("medium" if ctx.gpu else "small")
    prompts = make_prompts(4, 8, model.vocab_size, seed=1)
    figures: dict[str, Any] = {"model_parameters": model.num_parameters, "device": ctx.device}
    problems: list[str] = []
    parts: list[str] = []
    held = 0
    same_tokens = True
    with create_executor(reference_config(ctx, model, backend="uni")) as executor:

        def tokens() -> list[list[int]]:
            return generate(executor, prompts, max_new_tokens=8, batch_size=4).tokens

        def memory() -> dict[str, int]:
            usage: dict[str, int] = executor.collective_rpc(_memory_probe)[0]
            return usage

        before = tokens()
        for level in (1, 2):
            awake = memory()
            executor.sleep(level)
            asleep = memory()
            executor.wake_up()
            woken = memory()
            held = awake["weight_bytes"] + awake["kv_cache_bytes"]
            figures[f"level{level}"] = {"awake": awake, "asleep": asleep, "woken": woken}
            if asleep["weight_bytes"] or asleep["kv_cache_bytes"]:
                problems.append(f"level {level}: the worker still holds tensors while asleep")
            if woken["weight_bytes"] != awake["weight_bytes"]:
                problems.append(f"level {level}: wake_up did not restore every weight")
            if tokens() != before:
                same_tokens = False
                problems.append(f"level {level}: different tokens after wake_up")
            if ctx.gpu:
                freed = awake["cuda_used"] - asleep["cuda_used"]
                retaken = woken["cuda_used"] - asleep["cuda_used"]
                reserved = (awake["cuda_reserved"], asleep["cuda_reserved"], woken["cuda_reserved"])
                parts.append(
                    f"sleep({level}) freed {mib(freed)} of the device (mem_get_info), wake took "
                    f"{mib(retaken)} back; reserved {' -> '.join(map(mib, reserved))}"
                )
                for did, n in (("sleep freed", freed), ("wake_up took back", retaken)):
                    if n < MEMORY_FRACTION * held:
                        problems.append(
                            f"level {level}: {did} {mib(n)}, less than {MEMORY_FRACTION:.0%} "
                            f"of the {mib(held)} of weights and KV cache"
                        )
            else:
                # On the CPU the KV cache is mapped lazily (only its touched pages count in
                # the process's memory), so what must be freed is the weights.
                freed = awake["host_bytes"] - asleep["host_bytes"]
                weights = awake["weight_bytes"]
                parts.append(
                    f"sleep({level}) freed {mib(freed)} of host memory (weights {mib(weights)})"
                )
                if freed < MEMORY_FRACTION * weights:
                    problems.append(
                        f"level {level}: sleep freed {mib(freed)} of host memory, less than "
                        f"{MEMORY_FRACTION:.0%} of the {mib(weights)} of weights"
                    )
        figures["weights_and_kv_bytes"] = held
    summary = f"weights+KV {mib(held)}; " + "; ".join(parts)
    summary += f"; tokens after wake_up {'the same' if same_tokens else 'DIFFER'}"
    return judge(summary if ctx.gpu else f"dry run (host memory): {summary}", problems, figures)


def check_timing(ctx: Context) -> Outcome:
    import torch

    from executor_core import create_executor
    from executor_reference import StepInput, generate, make_prompts

    # On a GPU long prefills of a mid-size model: GPU work well above the kernel launches, so
    # a clock stopped before the GPU finished shows.
    size, batch, prompt_len = ("medium", 16, 448) if ctx.gpu else ("small", 4, 64)
    model = reference_model(size)
    prompts = make_prompts(batch, prompt_len, model.vocab_size, seed=2)
    slots = tuple(range(batch))
    config = reference_config(ctx, model, backend="uni", kv_slots=batch)
    with create_executor(config) as executor:

        def share(step: StepInput) -> tuple[float, StepOutput]:
            """The executor's share of ``step``: 1 - the worker's model time / the wall time
            around the call (synchronized on a GPU)."""
            if ctx.gpu:
                torch.cuda.synchronize()
            started = time.perf_counter()
            out: StepOutput = executor.execute_model(step)
            if ctx.gpu:
                torch.cuda.synchronize()
            return 1.0 - out.model_time_s / (time.perf_counter() - started), out

        def run(prefills: int, decodes: int) -> tuple[list[float], list[float], list[float]]:
            prefill_shares, decode_shares, model_ms = [], [], []
            prefill = StepInput(batch_id=0, slots=slots, token_ids=prompts, start_pos=0)
            for _ in range(prefills):
                part, out = share(prefill)
                prefill_shares.append(part)
                model_ms.append(out.model_time_s * 1e3)
            for j in range(decodes):
                tokens = [[t] for t in out.next_tokens]
                step = StepInput(
                    batch_id=0, slots=slots, token_ids=tokens, start_pos=prompt_len + j
                )
                part, out = share(step)
                decode_shares.append(part)
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
    figures: dict[str, Any] = {
        "device": ctx.device,
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
        f"{'synchronized ' if ctx.gpu else 'dry run (cpu): '}wall vs worker model_time_s: "
        f"executor share median {prefill_median:.1%} over {len(prefill_shares)} prefills "
        f"(model {statistics.median(prefill_model_ms):.2f} ms each), {decode_median:.1%} over "
        f"{len(decode_shares)} decodes; generate() reports executor {job.executor_share:.1%}, "
        f"model {job.model_share:.1%}"
    )
    problems: list[str] = []
    outside = [s for s in prefill_shares + decode_shares if not 0.0 <= s < 1.0]
    if outside:
        problems.append(f"{len(outside)} step(s) with a share outside [0, 1): {outside[:4]}")
    if not 0.0 <= job.executor_share < 1.0:
        problems.append(f"generate()'s executor share {job.executor_share} is outside [0, 1)")
    if max(prefill_median, decode_median) > MAX_INPROCESS_SHARE:
        problems.append(
            f"an in-process backend's median share is above {MAX_INPROCESS_SHARE:.0%}: the "
            "worker's clock misses part of the step"
        )
    return judge(summary, problems, figures)
