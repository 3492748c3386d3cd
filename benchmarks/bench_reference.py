"""Reference model: step latency, tokens/s and executor share on every backend, side by side.

Runs the same greedy generation (same prompts, same weights) on uni tp1 (the baseline), mp
tp2, mp pp2 with and without async overlap, and ray tp2, in one run, and reports each
against the baseline. Then measures sleep/wake: time and memory released per level.

    .venv/bin/python benchmarks/bench_reference.py            # defaults: medium model
    .venv/bin/python benchmarks/bench_reference.py --model-size small --json out.json

The default model (medium, 31M parameters) gives each step enough work for pipeline overlap
to show; with the small one, per-step fixed costs (gloo latency, process wake-ups) dominate.

The executor share is the executor's time on each step's path over the step's latency,
summed over steps (``GenerationResult.executor_share``). With batches in flight at once the
steps overlap, so the table also gives executor seconds per wall second
(``executor_time_per_wall_s``), which adds up the executor time of overlapping steps.

Layouts whose backend is not installed are skipped (and said so). Only the backends' plugins
are loaded (``EXECUTOR_PLUGINS``, in the driver and the workers), so that the development
install's observers (the test fixtures, ``executor-plugin-otel``) do not run on every call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from executor_core import Executor, ExecutorConfig, create_executor

try:
    from executor_core.backend import default_registry
except ImportError:  # the tree before the API tiers (before/after runs in one sitting)
    from executor_core import default_registry  # type: ignore[attr-defined,no-redef]
from executor_reference import (
    MODEL_SIZES,
    GenerationResult,
    ensure_checkpoint,
    generate,
    make_prompts,
)

#: (label, backend, tp, pp, async overlap)
LAYOUTS: list[tuple[str, str, int, int, bool]] = [
    ("uni tp1", "uni", 1, 1, False),
    ("mp tp2", "mp", 2, 1, False),
    ("mp pp2", "mp", 1, 2, False),
    ("mp pp2 overlap", "mp", 1, 2, True),
    ("ray tp2", "ray", 2, 1, False),
    ("ray pp2 overlap", "ray", 1, 2, True),
]


def _config(checkpoint: Path, backend: str, tp: int, pp: int, kv_slots: int) -> ExecutorConfig:
    return ExecutorConfig(
        backend=backend,
        worker_cls="executor_reference:ReferenceWorker",
        worker_kwargs={"checkpoint": str(checkpoint), "kv_slots": kv_slots, "cpu_threads": 1},
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        # No rpc_timeout: with one, uni routes every call through a helper thread, which
        # would be counted as executor time.
    )


def _run(
    executor: Executor, prompts: list[list[int]], args: argparse.Namespace, concurrency: int
) -> GenerationResult:
    return generate(
        executor,
        prompts,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        max_concurrent_batches=concurrency,
    )


def bench_generation(checkpoint: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    installed = {spec.name for spec in default_registry().backends()}
    vocab = MODEL_SIZES[args.model_size].vocab_size
    prompts = make_prompts(args.requests, args.prompt_len, vocab, seed=1)
    rows: list[dict[str, Any]] = []
    reference_tokens: list[list[int]] | None = None
    for label, backend, tp, pp, overlap in LAYOUTS:
        if backend not in installed:
            print(f"skip {label}: backend {backend!r} not installed", file=sys.stderr)
            continue
        kv_slots = args.batch_size * max(2, pp)
        started = time.perf_counter()
        with create_executor(_config(checkpoint, backend, tp, pp, kv_slots)) as executor:
            startup = time.perf_counter() - started
            concurrency = executor.max_concurrent_batches if overlap else 1
            _run(executor, prompts[: args.batch_size * concurrency], args, concurrency)  # warm
            results = [_run(executor, prompts, args, concurrency) for _ in range(args.repeat)]
        best = max(results, key=lambda r: r.tokens_per_s)
        if reference_tokens is None:
            reference_tokens = best.tokens
        rows.append(
            {
                "layout": label,
                "concurrency": concurrency,
                "startup_s": startup,
                "tokens_per_s": best.tokens_per_s,
                "p50_ms": statistics.median(r.latency_percentile(50) for r in results) * 1e3,
                "p99_ms": statistics.median(r.latency_percentile(99) for r in results) * 1e3,
                "executor_share": statistics.median(r.executor_share for r in results),
                "executor_per_wall": statistics.median(r.executor_time_per_wall_s for r in results),
                "same_tokens": best.tokens == reference_tokens,
            }
        )
        print(f"done {label}", file=sys.stderr)
    return rows


def _released(before: list[dict[str, int]], after: list[dict[str, int]]) -> int:
    return sum(b["host_bytes"] - a["host_bytes"] for b, a in zip(before, after, strict=True))


def bench_sleep(checkpoint: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    installed = {spec.name for spec in default_registry().backends()}
    rows: list[dict[str, Any]] = []
    for label, backend, tp in [("uni tp1", "uni", 1), ("mp tp2", "mp", 2)]:
        if backend not in installed:
            continue
        with create_executor(_config(checkpoint, backend, tp, 1, 16)) as executor:
            for level in (1, 2):
                sleeps, wakes, released = [], [], []
                for _ in range(args.repeat):
                    awake = executor.collective_rpc("memory_usage")
                    t0 = time.perf_counter()
                    executor.sleep(level)
                    t1 = time.perf_counter()
                    asleep = executor.collective_rpc("memory_usage")
                    t2 = time.perf_counter()
                    executor.wake_up()
                    t3 = time.perf_counter()
                    sleeps.append(t1 - t0)
                    wakes.append(t3 - t2)
                    released.append(_released(awake, asleep))
                weights = sum(u["weight_bytes"] + u["kv_cache_bytes"] for u in awake)
                rows.append(
                    {
                        "layout": label,
                        "level": level,
                        "sleep_ms": statistics.median(sleeps) * 1e3,
                        "wake_ms": statistics.median(wakes) * 1e3,
                        "released_mb": statistics.median(released) / 2**20,
                        "held_mb": weights / 2**20,
                    }
                )
    return rows


def _print_tables(gen: list[dict[str, Any]], sleep: list[dict[str, Any]]) -> None:
    base = gen[0]["tokens_per_s"] if gen else 0.0
    sync_pp = next((r for r in gen if r["layout"] == "mp pp2"), None)
    print(
        "| layout | batches in flight | tokens/s | vs uni tp1 | step p50 (ms) | step p99 (ms) "
        "| executor share | executor s per wall s | same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in gen:
        print(
            f"| {r['layout']} | {r['concurrency']} | {r['tokens_per_s']:.0f} | "
            f"{r['tokens_per_s'] / base:.2f}x | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
            f"{r['executor_share']:.1%} | {r['executor_per_wall']:.3f} | "
            f"{'yes' if r['same_tokens'] else 'NO'} |"
        )
    overlap = next((r for r in gen if r["layout"] == "mp pp2 overlap"), None)
    if sync_pp and overlap:
        gain = overlap["tokens_per_s"] / sync_pp["tokens_per_s"]
        print(f"\noverlap gain at mp pp2: {gain:.2f}x tokens/s")
    if sleep:
        print(
            "\n| layout | level | sleep (ms) | wake (ms) | host memory released (MB) "
            "| weights + KV cache held (MB) |"
        )
        print("|---|---|---|---|---|---|")
        for r in sleep:
            print(
                f"| {r['layout']} | {r['level']} | {r['sleep_ms']:.1f} | {r['wake_ms']:.1f} | "
                f"{r['released_mb']:.1f} | {r['held_mb']:.1f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="medium")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=2, help="runs per layout (best/median)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    os.environ.setdefault("EXECUTOR_PLUGINS", "uniproc,multiproc,ray,reference")
    with tempfile.TemporaryDirectory(prefix="bench-reference-") as tmp:
        checkpoint = ensure_checkpoint(MODEL_SIZES[args.model_size], tmp)
        gen = bench_generation(checkpoint, args)
        sleep = bench_sleep(checkpoint, args)
    _print_tables(gen, sleep)
    if args.json:
        Path(args.json).write_text(json.dumps({"generation": gen, "sleep": sleep}, indent=2))


if __name__ == "__main__":
    main()
