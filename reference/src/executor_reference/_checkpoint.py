"""The reference model's checkpoint: one safetensors file, written once from the seed, from
which every rank reads only its own shard."""

from __future__ import annotations

import enum
import hashlib
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ._config import ModelConfig, stage_layers

__all__ = [
    "CONFIG_METADATA_KEY",
    "Split",
    "checkpoint_layout",
    "create_checkpoint",
    "ensure_checkpoint",
    "load_shard",
    "read_config",
    "shard_range",
    "stage_tensor_names",
    "tensor_nbytes",
]

#: safetensors metadata key holding the model config as JSON.
CONFIG_METADATA_KEY = "executor_reference_config"


class Split(enum.Enum):
    """How a tensor is divided among the ranks of a tensor-parallel group."""

    #: Every rank holds all of it (norm weights).
    REPLICATED = "replicated"
    #: Split along dim 0: column-parallel linears (output features), vocabulary rows.
    ROWS = "rows"
    #: Split along dim 1: row-parallel linears (input features).
    COLUMNS = "columns"


def checkpoint_layout(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], Split]]:
    """Every tensor of the full model: its shape and how tensor parallelism splits it."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    layout: dict[str, tuple[tuple[int, ...], Split]] = {"embed.weight": ((v, h), Split.ROWS)}
    for layer in range(config.num_layers):
        p = f"layers.{layer}."
        layout[p + "attn_norm.weight"] = ((h,), Split.REPLICATED)
        for proj in ("q_proj", "k_proj", "v_proj"):
            layout[p + f"attn.{proj}.weight"] = ((h, h), Split.ROWS)  # heads split by rows
        layout[p + "attn.o_proj.weight"] = ((h, h), Split.COLUMNS)
        layout[p + "mlp_norm.weight"] = ((h,), Split.REPLICATED)
        layout[p + "mlp.gate_proj.weight"] = ((i, h), Split.ROWS)
        layout[p + "mlp.up_proj.weight"] = ((i, h), Split.ROWS)
        layout[p + "mlp.down_proj.weight"] = ((h, i), Split.COLUMNS)
    layout["norm.weight"] = ((h,), Split.REPLICATED)
    layout["lm_head.weight"] = ((v, h), Split.ROWS)
    return layout


def stage_tensor_names(config: ModelConfig, pipeline_parallel_size: int, pp_rank: int) -> list[str]:
    """The tensors pipeline stage ``pp_rank`` needs: the embedding on the first stage, its
    own layers, and the final norm and LM head on the last."""
    layers = stage_layers(config.num_layers, pipeline_parallel_size, pp_rank)
    names = []
    for name in checkpoint_layout(config):
        if name.startswith("layers."):
            if int(name.split(".")[1]) in layers:
                names.append(name)
        elif name == "embed.weight":
            if pp_rank == 0:
                names.append(name)
        elif pp_rank == pipeline_parallel_size - 1:
            names.append(name)
    return names


def shard_range(size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """The ``[start, stop)`` of a dimension of ``size`` that TP rank ``tp_rank`` holds."""
    if size % tp_size:
        raise ValueError(f"a dimension of {size} does not split over {tp_size} ranks")
    step = size // tp_size
    return tp_rank * step, (tp_rank + 1) * step


def _init_std(name: str, shape: tuple[int, ...], config: ModelConfig) -> float:
    if name == "embed.weight":
        return 1.0
    if name == "lm_head.weight":
        # Wide logits (std ~4): greedy choices have clear margins, so float rounding that
        # differs between parallel layouts does not flip them.
        return 4.0 / math.sqrt(config.hidden_size)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 1.0 / math.sqrt(shape[1] * 2 * config.num_layers)
    return 1.0 / math.sqrt(shape[1])


def _dtype(config: ModelConfig) -> torch.dtype:
    dtype: torch.dtype = getattr(torch, config.dtype)
    return dtype


def create_checkpoint(config: ModelConfig, path: str | os.PathLike[str]) -> Path:
    """Create the model's weights from ``config.seed`` and save them at ``path``.

    Written to a temporary name and renamed, so a reader never sees a partial file.
    """
    target = Path(path)
    generator = torch.Generator().manual_seed(config.seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, (shape, split) in checkpoint_layout(config).items():
        if split is Split.REPLICATED:  # norm weights: near one
            weight = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        else:
            weight = torch.randn(shape, generator=generator) * _init_std(name, shape, config)
        tensors[name] = weight.to(_dtype(config))
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        save_file(tensors, str(partial), metadata={CONFIG_METADATA_KEY: config.to_json()})
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def read_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The model config stored in the checkpoint at ``path``."""
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    text = metadata.get(CONFIG_METADATA_KEY)
    if text is None:
        raise ValueError(
            f"{path} is not a reference-model checkpoint (no {CONFIG_METADATA_KEY!r} metadata); "
            "create one with executor_reference.ensure_checkpoint"
        )
    return ModelConfig.from_json(text)


def ensure_checkpoint(config: ModelConfig, directory: str | os.PathLike[str]) -> Path:
    """The checkpoint of ``config`` in ``directory``, created there unless already present."""
    digest = hashlib.sha256(config.to_json().encode()).hexdigest()[:16]
    path = Path(directory) / f"reference-{digest}.safetensors"
    if path.exists():
        try:
            if read_config(path) == config:
                return path
        except (OSError, ValueError):  # unreadable or foreign: write it again
            pass
    Path(directory).mkdir(parents=True, exist_ok=True)
    return create_checkpoint(config, path)


def load_shard(
    path: str | os.PathLike[str],
    config: ModelConfig,
    names: Iterable[str],
    *,
    tp_rank: int,
    tp_size: int,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Read TP rank ``tp_rank``'s part of each tensor in ``names`` from the checkpoint.

    Only the rank's slice of each sharded tensor is read (safetensors maps the file and
    copies just the requested rows or columns), never the whole tensor.
    """
    layout = checkpoint_layout(config)
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt", device=str(device)) as handle:
        for name in names:
            shape, split = layout[name]
            part = handle.get_slice(name)
            stored = tuple(part.get_shape())
            if stored != shape:
                raise ValueError(
                    f"{path}: tensor {name!r} has shape {stored}, the config says {shape}; "
                    "the checkpoint does not match its model config"
                )
            if split is Split.ROWS:
                start, stop = shard_range(shape[0], tp_rank, tp_size)
                tensor = part[start:stop]
            elif split is Split.COLUMNS:
                start, stop = shard_range(shape[1], tp_rank, tp_size)
                tensor = part[:, start:stop]
            else:
                tensor = part[:]
            out[name] = tensor.contiguous()
    return out


def tensor_nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Total bytes of ``tensors``."""
    return sum(t.numel() * t.element_size() for t in tensors.values())
