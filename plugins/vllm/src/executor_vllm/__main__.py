"""``python -m executor_vllm``: vLLM generates on the SDK, with a tiny model made on the fly.

Prints the tokens of each prompt, the backend, and the time to start and to generate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    """Parse the options, make the tiny model, generate, print; return the exit status."""
    parser = argparse.ArgumentParser(prog="python -m executor_vllm", description=__doc__)
    parser.add_argument(
        "--backend", default=None, help="SDK backend (default: uni for 1 rank, else mp)"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (default 1)")
    parser.add_argument("--options", default=None, help="the backend's options, a JSON object")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--json", action="store_true", help="print one JSON line instead")
    args = parser.parse_args(argv)
    section: dict[str, object] = {}
    if args.backend is not None:
        section["backend"] = args.backend
    if args.options is not None:
        try:
            section["backend_options"] = json.loads(args.options)
        except json.JSONDecodeError as exc:
            parser.error(f"--options is not JSON: {exc}")
    from . import PROMPTS, TINY_ENGINE_ARGS, make_tiny_model, one_core_per_rank

    if args.tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", one_core_per_rank(args.tp))

    with tempfile.TemporaryDirectory(prefix="executor-vllm-demo-") as work:
        os.environ.setdefault("VLLM_RPC_BASE_PATH", os.path.join(work, "rpc"))
        os.makedirs(os.environ["VLLM_RPC_BASE_PATH"], exist_ok=True)
        model = make_tiny_model(os.path.join(work, "model"))
        from vllm import LLM, SamplingParams

        start = time.perf_counter()
        llm = LLM(
            model=str(model),
            **TINY_ENGINE_ARGS,
            tensor_parallel_size=args.tp,
            distributed_executor_backend="executor_vllm.SdkExecutor",
            additional_config={"executor_sdk": section},
        )
        started = time.perf_counter() - start
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(list(PROMPTS), params, use_tqdm=False)
        took = time.perf_counter() - start
        backend = section.get("backend") or ("uni" if args.tp == 1 else "mp")
        tokens = [list(out.outputs[0].token_ids) for out in outputs]
        llm.llm_engine.engine_core.shutdown()
    count = sum(len(t) for t in tokens)
    if args.json:
        print(
            json.dumps(
                {
                    "backend": backend,
                    "tp": args.tp,
                    "tokens": tokens,
                    "start_s": started,
                    "generate_s": took,
                }
            )
        )
    else:
        for prompt, ids in zip(PROMPTS, tokens, strict=True):
            print(f"{prompt!r} -> {ids}")
        print(
            f"backend {backend}, tp {args.tp}: started in {started:.1f} s, "
            f"{count} tokens in {took:.2f} s ({count / took:.0f} tokens/s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
