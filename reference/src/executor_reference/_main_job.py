"""``executor run``: the main job. Greedy decoding with the reference model on any backend.

The plugin adds the command through :func:`add_run_command`. This module imports no torch at
module level: ``executor --help`` and ``executor backends`` stay fast, and torch is imported
only when the job runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from executor_core import Executor

    from ._result import GenerationResult

__all__ = ["add_run_arguments", "add_run_command", "run_main_job"]

_MODEL_SIZE_NAMES = ("tiny", "small", "medium", "large")  # keys of MODEL_SIZES (_config.py)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, not {value}")
    return value


def _backend_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def add_run_command(commands: argparse._SubParsersAction[Any]) -> None:
    """Add ``executor run`` to the ``executor`` command's subcommands."""
    run = commands.add_parser("run", help="run the main job: the reference model on a backend")
    add_run_arguments(run)
    run.set_defaults(func=run_main_job)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``executor run`` to ``parser``, with their defaults.

    A tool that runs what the main job runs by default (``scripts/gpu_check.py`` does) reads
    those from ``parser.parse_args([])``: ``model_size``, ``seed``, ``requests``,
    ``prompt_len``, ``max_new_tokens``, ``batch_size`` and the rest.
    """
    parser.add_argument(
        "--backend",
        default="auto",
        help="backend name or alias ('uni', 'mp', 'ray', 'external_launcher' under torchrun), "
        "or 'auto' (default: uni for one worker, else mp)",
    )
    parser.add_argument("--tp", type=_positive, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=_positive, default=1, help="pipeline-parallel stages")
    parser.add_argument("--requests", type=_positive, default=16, help="prompts to complete")
    parser.add_argument("--prompt-len", type=_positive, default=16, help="tokens per prompt")
    parser.add_argument(
        "--max-new-tokens", type=_positive, default=32, help="tokens to generate per prompt"
    )
    parser.add_argument("--batch-size", type=_positive, default=8, help="prompts per batch")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts")
    parser.add_argument(
        "--model-size",
        choices=_MODEL_SIZE_NAMES,
        default="small",
        help="reference model size (default: small, seconds on 2 CPU cores)",
    )
    parser.add_argument(
        "--async-overlap",
        action="store_true",
        help="keep max_concurrent_batches batches in flight (2 at pp=1, pp otherwise) instead "
        "of one step at a time",
    )
    parser.add_argument("--device", default="cpu", help="device type: cpu (gloo) or cuda (nccl)")
    parser.add_argument(
        "--num-nodes",
        type=_positive,
        default=1,
        help="machines the workers span (mp: start 'executor node' on each of the others)",
    )
    parser.add_argument(
        "--distributed-host",
        default="127.0.0.1",
        help="this machine's address as the other nodes reach it (default 127.0.0.1: this "
        "machine only)",
    )
    parser.add_argument(
        "--backend-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        type=_backend_option,
        help="a backend option, VALUE in JSON or a plain string (repeatable), e.g. node_port=29551",
    )
    parser.add_argument(
        "--threads",
        type=_positive,
        default=1,
        help="torch intra-op threads per worker on the CPU (default 1: the reference sizes' "
        "operations are too small to split)",
    )
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="directory for the reference checkpoint, kept and reused "
        "(default: a temporary one, removed at the end)",
    )
    parser.add_argument(
        "--output-json", default=None, help="also write the summary and tokens to this file"
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument(
        "--recover",
        action="store_true",
        help="give the executor a recovery policy: a worker's death restarts the workers, and "
        "the job resubmits the steps in flight (docs/recovery.md)",
    )
    parser.add_argument(
        "--kill-rank",
        type=int,
        default=None,
        metavar="RANK",
        help="a fault, for trying recovery: SIGKILL this rank's worker process at --kill-at-step",
    )
    parser.add_argument(
        "--kill-at-step",
        type=_positive,
        default=None,
        metavar="STEP",
        help="the step (counted from 1) after which --kill-rank is killed",
    )


@contextlib.contextmanager
def _checkpoint_dir(path: str | None) -> Iterator[str]:
    if path is not None:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="executor-run-") as tmp:
        yield tmp


@contextlib.contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Callable[[int], None] | None]:
    if not enabled:
        yield None
        return
    try:
        # deferred: only the interactive job needs it; tqdm ships no type information
        from tqdm import tqdm  # type: ignore[import-untyped]
    except ImportError:  # tqdm comes with executor-reference; run without a bar otherwise
        yield None
        return
    with tqdm(total=total, unit="tok", desc="generating", leave=False) as bar:
        yield bar.update


def _backend_name(executor: Executor) -> str:
    try:
        return executor.registry.resolve_name(executor.config)
    except Exception:  # noqa: BLE001 - a class or qualname backend has no registered name
        return type(executor).__name__


def _summary(
    args: argparse.Namespace,
    executor: Executor,
    result: GenerationResult,
    startup_s: float,
    num_parameters: int,
) -> dict[str, Any]:
    return {
        "backend": _backend_name(executor),
        "executor": type(executor).__name__,
        "tp": args.tp,
        "pp": args.pp,
        "world_size": executor.world_size,
        "device": args.device,
        "model_size": args.model_size,
        "parameters": num_parameters,
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size,
        "concurrent_batches": result.max_concurrent_batches,
        "startup_s": startup_s,
        "generated_tokens": result.generated_tokens,
        "wall_s": result.wall_time_s,
        "tokens_per_s": result.tokens_per_s,
        "steps": len(result.steps),
        "step_latency_p50_ms": result.latency_percentile(50) * 1e3,
        "step_latency_p99_ms": result.latency_percentile(99) * 1e3,
        "executor_share": result.executor_share,
        "model_share": result.model_share,
        "recoveries": len(result.recoveries),
        "recovery_s": list(result.recoveries),
        "lost_ranks": [list(ranks) for ranks in result.lost_ranks],
        "restarted_ranks": [list(ranks) for ranks in result.restarted_ranks],
    }


def _print_summary(s: dict[str, Any], out: TextIO) -> None:
    other = max(0.0, 1.0 - s["executor_share"] - s["model_share"])
    lines = [
        f"executor run: backend={s['backend']} ({s['executor']}) tp={s['tp']} pp={s['pp']} "
        f"world_size={s['world_size']} device={s['device']}",
        f"model: reference {s['model_size']} ({s['parameters'] / 1e6:.1f}M parameters); "
        f"{s['requests']} requests x {s['max_new_tokens']} new tokens, batch {s['batch_size']}, "
        f"{s['concurrent_batches']} batch(es) in flight",
        f"startup: {s['startup_s']:.2f} s until the workers were ready",
        f"generated {s['generated_tokens']} tokens in {s['wall_s']:.2f} s: "
        f"{s['tokens_per_s']:.1f} tokens/s",
        f"step latency: p50 {s['step_latency_p50_ms']:.2f} ms, p99 {s['step_latency_p99_ms']:.2f} "
        f"ms over {s['steps']} steps",
        f"time split: executor {s['executor_share']:.1%}, model {s['model_share']:.1%}, "
        f"driver and waiting {other:.1%} (of each step's time)",
    ]
    for lost, restarted, took in zip(
        s["lost_ranks"], s["restarted_ranks"], s["recovery_s"], strict=True
    ):
        if len(restarted) < s["world_size"]:
            how = (
                f"{len(restarted)} rank(s) replaced ({restarted}; the others kept their "
                "processes and weights)"
            )
        else:
            how = "every rank restarted (a group restart)"
        lines.append(
            f"recovery: rank(s) {lost} died; {how} and the steps in flight resubmitted, "
            f"{took:.2f} s from the failed step to the next result"
        )
    print("\n".join(lines), file=out)


def _worker_pid(worker: Any) -> int:
    return os.getpid()


def _killing(
    executor: Executor, rank: int, at_step: int, on_step: Callable[[int], None] | None
) -> Callable[[int], None]:
    """``on_step`` that also SIGKILLs ``rank``'s worker process after step ``at_step``."""
    pid = executor.collective_rpc(_worker_pid)[rank]
    if pid == os.getpid():
        raise ValueError(f"rank {rank} runs in this process: --kill-rank needs worker processes")
    steps = 0

    def step(tokens: int) -> None:
        nonlocal steps
        steps += 1
        if steps == at_step:
            os.kill(pid, signal.SIGKILL)
        if on_step is not None:
            on_step(tokens)

    return step


def run_main_job(args: argparse.Namespace) -> int:
    """Run greedy generation with the reference model and print a summary."""
    try:
        import torch  # noqa: F401 - fail early, with the fix, when torch is missing
    except ImportError:
        print(
            "executor run: needs torch (a dependency of executor-reference); install it "
            "with pip install executor-reference",
            file=sys.stderr,
        )
        return 1
    import attrs

    from executor_core import ExecutorConfig, ExecutorError, RecoveryPolicy, create_executor

    from ._checkpoint import ensure_checkpoint
    from ._config import MODEL_SIZES
    from ._generate import generate, make_prompts

    if (args.kill_rank is None) != (args.kill_at_step is None):
        print("executor run: error: give --kill-rank and --kill-at-step together", file=sys.stderr)
        return 2
    if args.kill_rank is not None and not 0 <= args.kill_rank < args.tp * args.pp:
        print(
            f"executor run: error: --kill-rank {args.kill_rank} is not a rank of tp*pp="
            f"{args.tp * args.pp} workers",
            file=sys.stderr,
        )
        return 2
    model = attrs.evolve(MODEL_SIZES[args.model_size], seed=args.seed)
    # Under torchrun every process runs this job; only rank 0 talks.
    is_main = os.environ.get("RANK", "0") == "0" or args.backend != "external_launcher"
    try:
        model.check_parallel(args.tp, args.pp)
        with _checkpoint_dir(args.checkpoint_dir) as directory:
            checkpoint = ensure_checkpoint(model, directory)
            config = ExecutorConfig(
                backend=args.backend,
                worker_cls="executor_reference:ReferenceWorker",
                worker_kwargs={
                    "checkpoint": str(checkpoint),
                    "kv_slots": args.batch_size * max(args.pp, 2),
                    "seed": args.seed,
                    "cpu_threads": args.threads,
                },
                tensor_parallel_size=args.tp,
                pipeline_parallel_size=args.pp,
                device=args.device,
                async_scheduling=args.async_overlap,
                num_nodes=args.num_nodes,
                distributed_host=args.distributed_host,
                backend_options=dict(args.backend_option),
                recovery=RecoveryPolicy() if args.recover else None,
            )
            prompts = make_prompts(args.requests, args.prompt_len, model.vocab_size, args.seed)
            started = time.perf_counter()
            with create_executor(config) as executor:
                startup = time.perf_counter() - started
                concurrency = executor.max_concurrent_batches if args.async_overlap else 1
                total = args.requests * args.max_new_tokens
                with _progress(total, is_main and not args.no_progress) as on_step:
                    if args.kill_rank is not None:
                        on_step = _killing(executor, args.kill_rank, args.kill_at_step, on_step)
                    result = generate(
                        executor,
                        prompts,
                        max_new_tokens=args.max_new_tokens,
                        batch_size=args.batch_size,
                        max_concurrent_batches=concurrency,
                        on_step=on_step,
                    )
                summary = _summary(args, executor, result, startup, model.num_parameters)
    except (ExecutorError, ValueError) as exc:
        print(f"executor run: error: {exc}", file=sys.stderr)
        return 1
    if is_main:
        _print_summary(summary, sys.stdout)
        if args.output_json:
            with open(args.output_json, "w", encoding="utf-8") as fh:
                json.dump({"summary": summary, "tokens": result.tokens}, fh)
    return 0
