"""vLLM's engine on its own executors and on the adapter, side by side, at default options.

    .venv/bin/python benchmarks/bench_vllm.py [--rounds 3] [--requests 16] [--max-tokens 64]

Four engines, each in a fresh process, in ``--rounds`` interleaved rounds: vLLM's ``mp`` and
the adapter on ``mp`` at tensor parallel 2, vLLM's ``uni`` and the adapter on ``uni``. Each
makes the tiny offline model, warms up on one request, then generates ``--requests``
requests of ``--max-tokens`` greedy tokens (the engine core in the process, as
``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Step time is the engine core's ``step`` (schedule,
``execute_model``, ``sample_tokens``, update), median and p99 over every step of every
round; tokens/s is the output tokens over the generate call's wall time, median of rounds.
Also checks that every engine generated the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ENGINES = {
    "vllm mp, tp 2": ("mp", 2, None),
    "adapter mp, tp 2": ("executor_vllm.SdkExecutor", 2, "mp"),
    "vllm uni": ("uni", 1, None),
    "adapter uni": ("executor_vllm.SdkExecutor", 1, "uni"),
}


def _child(name: str, requests: int, max_tokens: int) -> None:
    executor, tp, backend = ENGINES[name]
    from executor_vllm import PROMPTS, TINY_ENGINE_ARGS, make_tiny_model

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            str(i % (os.cpu_count() or 1)) for i in range(tp)
        )

    shm_before = set(os.listdir("/dev/shm"))
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as work:
        os.environ["VLLM_RPC_BASE_PATH"] = work
        model = make_tiny_model(os.path.join(work, "model"))
        from vllm import LLM, SamplingParams

        extra = {"additional_config": {"executor_sdk": {"backend": backend}}} if backend else {}
        llm = LLM(
            model=str(model),
            **TINY_ENGINE_ARGS,
            distributed_executor_backend=executor,
            tensor_parallel_size=tp,
            **extra,
        )
        core = llm.llm_engine.engine_core.engine_core
        steps: list[float] = []
        step = core.step_fn

        def timed() -> object:
            start = time.perf_counter()
            out = step()
            steps.append(time.perf_counter() - start)
            return out

        core.step_fn = timed
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate([PROMPTS[0]], params, use_tqdm=False)  # warm-up
        steps.clear()
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        llm.llm_engine.engine_core.shutdown()
    for name in set(os.listdir("/dev/shm")) - shm_before:  # vLLM's own mp leaves its segments
        if "cpushm" in name:
            os.unlink(os.path.join("/dev/shm", name))
    print("RESULT " + json.dumps({"steps": steps, "wall": wall, "tokens": tokens}), flush=True)


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.requests, args.max_tokens)
        return
    results: dict[str, list[dict[str, object]]] = {name: [] for name in ENGINES}
    for round_ in range(args.rounds):
        for name in ENGINES:  # interleaved: each round runs every engine once
            cmd = [
                sys.executable,
                __file__,
                "--child",
                name,
                "--requests",
                str(args.requests),
                "--max-tokens",
                str(args.max_tokens),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                sys.exit(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            results[name].append(json.loads(lines[-1][7:]))
            print(f"round {round_ + 1}: {name} done", file=sys.stderr, flush=True)
    reference = results["vllm uni"][0]["tokens"]
    same = all(r["tokens"] == reference for runs in results.values() for r in runs)
    print(
        f"{args.rounds} rounds, {args.requests} requests x {args.max_tokens} tokens; "
        f"same tokens on every engine: {same}\n"
    )
    print(
        "| engine | step median (ms) | step mean (ms) | step p99 (ms) "
        "| tokens/s (median of rounds) | time vs vLLM's own | tokens/s per round |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    rates: dict[str, float] = {}
    for name, runs in results.items():
        steps: list[float] = [s for r in runs for s in r["steps"]]  # type: ignore[attr-defined]
        count = sum(len(t) for t in runs[0]["tokens"])  # type: ignore[arg-type]
        per_round = [count / float(r["wall"]) for r in runs]  # type: ignore[arg-type]
        rates[name] = statistics.median(per_round)
        base = rates.get(name.replace("adapter", "vllm"))
        ratio = f"{base / rates[name]:.2f}x" if name.startswith("adapter") and base else ""
        median, mean = statistics.median(steps) * 1e3, statistics.fmean(steps) * 1e3
        print(
            f"| {name} | {median:.2f} | {mean:.2f} "
            f"| {_p(steps, 0.99) * 1e3:.2f} | {rates[name]:.0f} | {ratio} "
            f"| {', '.join(f'{rate:.0f}' for rate in per_round)} |"
        )


if __name__ == "__main__":
    main()
