"""The reference model: a small tensor- and pipeline-parallel decoder-only transformer.

It ships with the SDK so that every backend can be exercised with real torch work and no
downloads. Driver side: :func:`ensure_checkpoint` writes the seeded weights once,
:class:`ReferenceWorker` is the ``worker_cls`` and :func:`generate` runs greedy decoding.
Importing this subpackage imports torch (``executor-core[torch]``).
"""

from ._checkpoint import (
    CONFIG_METADATA_KEY,
    Split,
    checkpoint_layout,
    create_checkpoint,
    ensure_checkpoint,
    load_shard,
    read_config,
    shard_range,
    stage_tensor_names,
    tensor_nbytes,
)
from ._config import DTYPES, MODEL_SIZES, ModelConfig, stage_layers
from ._generate import GenerationResult, StepRecord, generate, make_prompts
from ._model import KVCache, StageModel
from ._worker import SPMD_BACKENDS, ReferenceWorker, StepInput, StepOutput

__all__ = [
    "CONFIG_METADATA_KEY",
    "DTYPES",
    "MODEL_SIZES",
    "SPMD_BACKENDS",
    "GenerationResult",
    "KVCache",
    "ModelConfig",
    "ReferenceWorker",
    "Split",
    "StageModel",
    "StepInput",
    "StepOutput",
    "StepRecord",
    "checkpoint_layout",
    "create_checkpoint",
    "ensure_checkpoint",
    "generate",
    "load_shard",
    "make_prompts",
    "read_config",
    "shard_range",
    "stage_layers",
    "stage_tensor_names",
    "tensor_nbytes",
]
