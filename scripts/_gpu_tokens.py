"""The checks of scripts/gpu_check.py that the reference model computes the same thing on a GPU
as on the CPU: ``tokens`` (uni on cuda vs uni on cpu) and ``tokens_tp2`` (mp at tp=2 on two
GPUs vs uni on cpu), both running what ``executor run`` runs by default."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from _gpu_common import (
    CALL_TIMEOUT_S,
    FAIL,
    PASS,
    Context,
    Outcome,
    reference_config,
    reference_model,
)

if TYPE_CHECKING:
    from executor_core import Executor, ExecutorConfig
    from executor_reference import GenerationResult

#: A token difference counts as a rounding tie when the logits agreed this closely (max
#: absolute difference) up to it: fp32 kernels on a GPU and a CPU differ in the last bits.
TIE_MAX_LOGIT_DELTA = 1e-3


def _job() -> argparse.Namespace:
    """``executor run``'s default options."""
    from executor_reference import add_run_arguments

    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    return parser.parse_args([])


def main_job_config(
    ctx: Context, *, backend: str, device: str, tp: int = 1, **changes: Any
) -> ExecutorConfig:
    """The main job's config at ``executor run``'s defaults (``changes`` on top of it)."""
    import attrs

    job = _job()
    # kv_slots as executor run sizes it at pp=1.
    config = reference_config(
        ctx,
        reference_model(job.model_size, job.seed),
        backend=backend,
        device=device,
        tp=tp,
        kv_slots=job.batch_size * 2,
    )
    return attrs.evolve(config, **changes)


def main_job(
    ctx: Context, *, backend: str, device: str, tp: int = 1, executor: Executor | None = None
) -> GenerationResult:
    """Greedy tokens (and logits) of the main job at ``executor run``'s default options: its
    model size, seed, prompts and batch (on ``executor`` if given: one of
    :func:`main_job_config`'s)."""
    from executor_core import create_executor
    from executor_reference import generate, make_prompts

    job = _job()
    vocab = reference_model(job.model_size, job.seed).vocab_size
    prompts = make_prompts(job.requests, job.prompt_len, vocab, job.seed)

    def run(executor: Executor) -> GenerationResult:
        return generate(
            executor,
            prompts,
            max_new_tokens=job.max_new_tokens,
            batch_size=job.batch_size,
            return_logits=True,
            timeout=CALL_TIMEOUT_S,
        )

    if executor is not None:
        return run(executor)
    with create_executor(main_job_config(ctx, backend=backend, device=device, tp=tp)) as fresh:
        return run(fresh)


def compare_tokens(reference: GenerationResult, other: GenerationResult, label: str) -> Outcome:
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


def check_tokens(ctx: Context) -> Outcome:
    reference = main_job(ctx, backend="uni", device="cpu")
    if ctx.gpu:
        other = main_job(ctx, backend="uni", device="cuda")
        return compare_tokens(reference, other, "uni cuda vs uni cpu")
    other = main_job(ctx, backend="mp", device="cpu", tp=2)
    return compare_tokens(reference, other, "dry run: mp tp=2 cpu vs uni cpu")


def check_tokens_tp2(ctx: Context) -> Outcome:
    reference = main_job(ctx, backend="uni", device="cpu")
    other = main_job(ctx, backend="mp", device="cuda", tp=2)
    return compare_tokens(reference, other, "mp tp=2 cuda vs uni cpu")
