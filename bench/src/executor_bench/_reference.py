"""The ``reference`` workload: the reference model's greedy generation on each layout, and
sleep/wake.

The same generation (same prompts and weights; the medium model, 31M parameters: each step
has work enough for a pipeline's overlap to show) on ``uni`` TP 1 (the baseline), ``mp`` TP 2,
``mp`` PP 2 with one batch in flight and with as many as it allows, ``ray`` TP 2 and PP 2
(those of the measured backends), each run once a round, the best round reported. The
executor share is the executor's time on each step's path over that step's latency
(``GenerationResult.executor_share``). Then sleep and wake-up at each level on ``uni`` and
``mp``: their time and the host memory released.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from executor_core import ExecutorConfig, create_executor

from ._intervals import count
from ._result import Table
from ._selection import not_installed

__all__ = ["ROUNDS", "measure", "missing"]

#: Rounds when ``--repeats`` is not given: generations per layout, the best reported.
ROUNDS = 2
#: (label, backend, tp, pp, batches in flight: all it allows)
LAYOUTS = [
    ("uni tp1", "uni", 1, 1, False),
    ("mp tp2", "mp", 2, 1, False),
    ("mp pp2", "mp", 1, 2, False),
    ("mp pp2", "mp", 1, 2, True),
    ("ray tp2", "ray", 2, 1, False),
    ("ray pp2", "ray", 1, 2, True),
]
#: Requests of :data:`NEW_TOKENS` greedy tokens, in batches of :data:`BATCH`.
REQUESTS, NEW_TOKENS, BATCH = 16, 32, 8
#: Targets: PP 2 with batches in flight at least 1.2x the tokens/s of one batch (its time per
#: token at most 1 / 1.2 of one batch's); the executor's share of a step on uni and mp.
OVERLAP_LIMIT, SHARE_LIMIT = 1 / 1.2, 0.03


def missing() -> str:
    """Why the workload cannot run here; empty if it can."""
    return not_installed("executor_reference", "torch")


def _config(checkpoint: Path, backend: str, tp: int, pp: int, kv_slots: int) -> ExecutorConfig:
    # No rpc_timeout: with one, uni routes every call through a helper thread.
    return ExecutorConfig(
        backend=backend,
        worker_cls="executor_reference:ReferenceWorker",
        worker_kwargs={"checkpoint": str(checkpoint), "kv_slots": kv_slots, "cpu_threads": 1},
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
    )


def _generation(checkpoint: Path, vocab: int, rounds: int, backends: list[str]) -> Table:
    from executor_reference import generate, make_prompts

    prompts = make_prompts(REQUESTS, 16, vocab, seed=1)
    table = Table(
        "reference",
        "",
        [
            "layout",
            "batches in flight",
            "tokens/s",
            "÷ uni tp1",
            "step p50 / p99",
            "executor share",
            "same tokens",
        ],
    )
    results: dict[tuple[str, int], list[Any]] = {}
    for label, backend, tp, pp, overlap in LAYOUTS:
        if backend not in backends:
            continue
        config = _config(checkpoint, backend, tp, pp, BATCH * max(2, pp))
        with create_executor(config) as executor:
            flight = executor.max_concurrent_batches if overlap else 1

            def run(some: list[list[int]], executor: Any = executor, flight: int = flight) -> Any:
                return generate(
                    executor,
                    some,
                    max_new_tokens=NEW_TOKENS,
                    batch_size=BATCH,
                    max_concurrent_batches=flight,
                )

            run(prompts[: BATCH * flight])  # warm-up
            results[label, flight] = [run(prompts) for _ in range(rounds)]
    first = next(iter(results.values()), [])
    for (label, flight), runs in results.items():
        best = max(runs, key=lambda r: r.tokens_per_s)
        p50, p99 = (statistics.median(r.latency_percentile(q) for r in runs) for q in (50, 99))
        share = [r.executor_share for r in runs]
        table.rows.append(
            [
                label,
                str(flight),
                f"{best.tokens_per_s:.0f}",
                f"{best.tokens_per_s / max(r.tokens_per_s for r in first):.2f}x",
                f"{p50 * 1e3:.2f} / {p99 * 1e3:.2f} ms",
                f"{statistics.median(share):.1%}",
                "yes" if best.tokens == first[0].tokens else "NO",
            ]
        )
        if label.startswith(("uni", "mp")):
            table.judge(f"{label}, {flight} in flight: executor share", share, SHARE_LIMIT)
    one, overlapped = results.get(("mp pp2", 1)), results.get(("mp pp2", 2))
    if one and overlapped:
        ratios = [a.tokens_per_s / b.tokens_per_s for a, b in zip(one, overlapped, strict=True)]
        table.judge("mp pp2, batches in flight: time per token / one batch", ratios, OVERLAP_LIMIT)
    return table


def _sleep(checkpoint: Path, rounds: int, backends: list[str]) -> Table:
    table = Table(
        "reference: sleep and wake-up",
        "",
        ["layout", "level", "sleep", "wake-up", "host memory released", "weights + KV cache held"],
    )
    for label, backend, tp in [("uni tp1", "uni", 1), ("mp tp2", "mp", 2)]:
        if backend not in backends:
            continue
        with create_executor(_config(checkpoint, backend, tp, 1, 16)) as executor:
            for level in (1, 2):
                sleeps, wakes, released = [], [], []
                for _ in range(rounds):
                    awake = executor.collective_rpc("memory_usage")
                    began = time.perf_counter()
                    executor.sleep(level)
                    sleeps.append(time.perf_counter() - began)
                    asleep = executor.collective_rpc("memory_usage")
                    began = time.perf_counter()
                    executor.wake_up()
                    wakes.append(time.perf_counter() - began)
                    released.append(
                        sum(
                            a["host_bytes"] - b["host_bytes"]
                            for a, b in zip(awake, asleep, strict=True)
                        )
                    )
                held = sum(u["weight_bytes"] + u["kv_cache_bytes"] for u in awake)
                table.rows.append(
                    [
                        label,
                        str(level),
                        f"{statistics.median(sleeps) * 1e3:.1f} ms",
                        f"{statistics.median(wakes) * 1e3:.1f} ms",
                        f"{statistics.median(released) / 2**20:.1f} MiB",
                        f"{held / 2**20:.1f} MiB",
                    ]
                )
    table.about = f"The medians of {count(rounds, 'sleep')} per level."
    return table


def measure(rounds: int, quick: bool, backends: list[str]) -> list[Table]:
    """Generation on each layout of ``backends``, then sleep/wake-up."""
    from executor_reference import MODEL_SIZES, ensure_checkpoint

    size = "small" if quick else "medium"
    with tempfile.TemporaryDirectory(prefix="bench-reference-") as tmp:
        checkpoint = ensure_checkpoint(MODEL_SIZES[size], tmp)
        generation = _generation(checkpoint, MODEL_SIZES[size].vocab_size, rounds, backends)
        sleep = _sleep(checkpoint, rounds, backends)
    generation.about = (
        f"The {size} model; {REQUESTS} requests of {NEW_TOKENS} greedy tokens, batches of "
        f"{BATCH}; the best of {count(rounds, 'round')} (step latencies and shares: their "
        "median). Same tokens: as uni tp1's."
    )
    return [generation, sleep]
