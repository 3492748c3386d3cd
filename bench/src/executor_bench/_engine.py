"""The ``engine`` workload: vLLM's engine on the adapter (executor-vllm) against vLLM's own
executors, at default options.

Four engines, each in a fresh process (``python -m executor_bench._engine``), once a round, in
interleaved rounds: vLLM's ``mp`` and the adapter on ``mp`` at tensor parallel 2 (one core a
rank), vLLM's ``uni`` and the adapter on ``uni``. Each makes the tiny offline model, warms up
on one request, then generates :data:`REQUESTS` requests of :data:`MAX_TOKENS` greedy tokens,
the engine core in the process. A step is the engine core's ``step``; tokens/s is the output
tokens over the generate call's wall time.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from ._intervals import count
from ._result import Table
from ._selection import not_installed
from ._workloads import percentile

__all__ = ["ROUNDS", "measure", "missing"]

#: Rounds when ``--repeats`` is not given; requests and greedy tokens each (``--quick``: 4, 16).
ROUNDS, REQUESTS, MAX_TOKENS = 5, 16, 64
#: Each engine: (``distributed_executor_backend``, tensor parallel size, the adapter's backend).
ENGINES = {
    "vLLM mp, tp 2": ("mp", 2, None),
    "adapter mp, tp 2": ("executor_vllm.SdkExecutor", 2, "mp"),
    "vLLM uni": ("uni", 1, None),
    "adapter uni": ("executor_vllm.SdkExecutor", 1, "uni"),
}
#: Target: the adapter's time per token at most vLLM's own executor's.
LIMIT = 1.0


def missing() -> str:
    """Why the workload cannot run here; empty if it can."""
    return not_installed("vllm", "executor_vllm")


def _generate(name: str, requests: int, max_tokens: int) -> dict[str, Any]:
    """One engine's generation, in this (fresh) process: its steps, wall time and tokens."""
    executor, tp, backend = ENGINES[name]
    from executor_vllm import PROMPTS, TINY_ENGINE_ARGS, make_tiny_model

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if tp > 1:
        cores = os.cpu_count() or 1
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % cores) for i in range(tp))
    shm_before = set(os.listdir("/dev/shm"))
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as work:
        os.environ["VLLM_RPC_BASE_PATH"] = work
        model = make_tiny_model(os.path.join(work, "model"))
        from vllm import LLM, SamplingParams

        args: dict[str, Any] = {**TINY_ENGINE_ARGS, "tensor_parallel_size": tp}
        if backend:
            args["additional_config"] = {"executor_sdk": {"backend": backend}}
        llm = LLM(model=str(model), distributed_executor_backend=executor, **args)
        core = llm.llm_engine.engine_core.engine_core  # type: ignore[attr-defined]  # in-process
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
    for leftover in set(os.listdir("/dev/shm")) - shm_before:  # vLLM's own mp leaves these
        if "cpushm" in leftover:
            os.unlink(os.path.join("/dev/shm", leftover))
    return {"steps": steps, "wall": wall, "tokens": tokens}


def measure(rounds: int, quick: bool, backends: list[str]) -> list[Table]:
    """Each engine in a fresh process, once a round; the adapter's against vLLM's own."""
    requests, max_tokens = (4, 16) if quick else (REQUESTS, MAX_TOKENS)
    engines = [name for name, (_, _, backend) in ENGINES.items() if backend in (None, *backends)]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name in engines:
            command = [sys.executable, "-m", __name__, name, str(requests), str(max_tokens)]
            proc = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise RuntimeError(f"{name} exited {proc.returncode}: {last}")
            runs[name].append(json.loads(lines[-1][len("RESULT ") :]))
    first = next(iter(runs.values()))[0]["tokens"]
    same = all(run["tokens"] == first for done in runs.values() for run in done)
    table = Table(
        "engine",
        f"vLLM's tiny offline model, {requests} requests of {max_tokens} greedy tokens, "
        f"{count(rounds, 'round')}; every engine generated the same tokens: "
        f"{'yes' if same else 'NO'}. Step: the engine core's, over every round's steps.",
        ["engine", "step median", "step p99", "tokens/s (median)", "time per token ÷ vLLM's"],
    )
    for name, done in runs.items():
        steps = [step for run in done for step in run["steps"]]
        rates = [sum(map(len, run["tokens"])) / run["wall"] for run in done]
        own = runs.get(name.replace("adapter", "vLLM"))
        ratios = (
            []
            if own is None or own is done
            else [
                sum(map(len, o["tokens"])) / o["wall"] / rate
                for o, rate in zip(own, rates, strict=True)
            ]
        )
        ratio = f"{statistics.median(ratios):.2f}x" if ratios else ""
        table.rows.append(
            [
                name,
                f"{statistics.median(steps) * 1e3:.2f} ms",
                f"{percentile(steps, 0.99) * 1e3:.2f} ms",
                f"{statistics.median(rates):.0f}",
                ratio,
            ]
        )
        if ratios:
            table.judge(f"{name}: time per token / vLLM's own", ratios, LIMIT)
    return [table]


if __name__ == "__main__":
    result = _generate(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    print("RESULT " + json.dumps(result), flush=True)
