"""A tiny Llama model made offline: a BPE tokenizer trained on a few lines and random weights."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["PROMPTS", "TINY_ENGINE_ARGS", "make_tiny_model", "one_core_per_rank"]

#: Prompts the demo, the tests and the benchmark generate from.
PROMPTS: tuple[str, ...] = (
    "The executor runs the workers",
    "Every rank gets the same call",
    "A ring in shared memory",
    "vLLM generates tokens on the SDK",
)

#: ``LLM(model, **TINY_ENGINE_ARGS, ...)``: the engine arguments the demo, the tests and the
#: benchmark give vLLM for the tiny model on a CPU (64 MiB of KV cache, no compilation).
TINY_ENGINE_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 256,
    "enforce_eager": True,
    "kv_cache_memory_bytes": 64 << 20,
    "seed": 0,
}


def one_core_per_rank(ranks: int) -> str:
    """A ``VLLM_CPU_OMP_THREADS_BIND`` value giving each of ``ranks`` ranks one core of its own
    (``'0|1'`` for two): on one NUMA node, vLLM's ``auto`` cannot split the cores."""
    cores = os.cpu_count() or 1
    return "|".join(str(rank % cores) for rank in range(ranks))


_TEXT = [
    *PROMPTS,
    "the quick brown fox jumps over the lazy dog",
    "tensor parallel ranks all reduce inside the forward pass",
    "one process, many processes, or a cluster behind one interface",
    "the scheduler sends a step and the driver rank replies",
]


def make_tiny_model(path: str | Path, *, seed: int = 0) -> Path:
    """Write a tiny random-weight Llama (hidden 128, 2 layers, 4 heads; about 2 MB) and its
    tokenizer to ``path`` (created if missing), offline and reproducibly; return ``path``.

    Enough for vLLM's engine to load and generate greedily: the tokens mean nothing, but the
    same weights give the same tokens on every executor.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_TEXT, trainer)
    # transformers leaves these constructors unannotated.
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    model.save_pretrained(out, safe_serialization=True)
    return out
