"""ModelConfig: the shape of the reference transformer, and how it splits across ranks."""

from __future__ import annotations

import json
from typing import Any

import attrs

from executor_core import ConfigError

__all__ = ["DTYPES", "MODEL_SIZES", "ModelConfig", "stage_layers"]

#: Parameter dtypes the reference model accepts (float32 on CPU; the others for GPUs).
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


def _positive(_inst: object, attr: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(attr.name, value, "must be an integer >= 1")


@attrs.frozen(kw_only=True)
class ModelConfig:
    """A decoder-only transformer: embedding, ``num_layers`` x (attention + MLP), norm, head.

    ``seed`` determines the weights: the same config always yields the same checkpoint.
    """

    vocab_size: int = attrs.field(default=256, validator=_positive)
    hidden_size: int = attrs.field(default=64, validator=_positive)
    num_layers: int = attrs.field(default=4, validator=_positive)
    num_heads: int = attrs.field(default=4, validator=_positive)
    intermediate_size: int = attrs.field(default=128, validator=_positive)
    #: Longest sequence (prompt + generated tokens) the KV cache holds.
    max_seq_len: int = attrs.field(default=96, validator=_positive)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    dtype: str = attrs.field(default="float32", validator=attrs.validators.in_(DTYPES))
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                "hidden_size",
                self.hidden_size,
                f"must be a multiple of num_heads={self.num_heads}",
            )
        if self.head_dim % 2:
            raise ConfigError(
                "hidden_size", self.hidden_size, "hidden_size / num_heads must be even (RoPE)"
            )

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.hidden_size // self.num_heads

    def check_parallel(self, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
        """Raise ConfigError unless the model splits evenly over ``tp`` x ``pp`` ranks."""
        tp, pp = tensor_parallel_size, pipeline_parallel_size
        for name in ("num_heads", "intermediate_size", "vocab_size"):
            value = getattr(self, name)
            if value % tp:
                raise ConfigError(
                    "tensor_parallel_size",
                    tp,
                    f"must divide the model's {name}={value}; pick a tp that does",
                )
        if pp > self.num_layers:
            raise ConfigError(
                "pipeline_parallel_size",
                pp,
                f"must be at most the model's num_layers={self.num_layers}",
            )

    def to_json(self) -> str:
        """The config as JSON (stored in the checkpoint's metadata)."""
        return json.dumps(attrs.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        """The config stored by :meth:`to_json`."""
        data: dict[str, Any] = json.loads(text)
        return cls(**data)

    @property
    def num_parameters(self) -> int:
        """Total parameters of the whole (unsplit) model."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = 4 * h * h + 3 * h * i + 2 * h
        return 2 * v * h + self.num_layers * per_layer + h


#: Named sizes for ``executor run --model-size``. ``tiny`` is for tests, ``small`` runs in
#: seconds on two CPU cores, ``medium`` loads the CPU, ``large`` (~1B parameters) is for GPUs.
MODEL_SIZES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),
    "small": ModelConfig(
        vocab_size=1024,
        hidden_size=256,
        num_layers=4,
        num_heads=8,
        intermediate_size=512,
        max_seq_len=256,
    ),
    "medium": ModelConfig(
        vocab_size=4096,
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        intermediate_size=1536,
        max_seq_len=512,
    ),
    "large": ModelConfig(
        vocab_size=32000,
        hidden_size=2048,
        num_layers=16,
        num_heads=16,
        intermediate_size=5632,
        max_seq_len=2048,
        dtype="bfloat16",
    ),
}


def stage_layers(num_layers: int, pipeline_parallel_size: int, pp_rank: int) -> range:
    """The decoder layers pipeline stage ``pp_rank`` runs: contiguous, as even as possible
    (earlier stages take one more when they do not divide evenly)."""
    base, extra = divmod(num_layers, pipeline_parallel_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))
