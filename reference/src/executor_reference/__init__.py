"""executor-reference: the reference model of the Executor SDK and its main job.

A small tensor- and pipeline-parallel decoder-only transformer, so that every backend can be
exercised with real torch work and no downloads. Driver side: :func:`ensure_checkpoint` writes
the seeded weights once, :class:`ReferenceWorker` is the ``worker_cls``
(``"executor_reference:ReferenceWorker"``) and :func:`generate` runs greedy decoding.

This module is also the plugin the registry imports (entry point ``reference`` in
``executor.plugins``): it adds ``executor run``, the main job. Importing it is cheap; the
names below load their code, and torch, on first use.
"""

from __future__ import annotations

from executor_core.backend import hookimpl, lazy_getattr

# Not typing.TYPE_CHECKING (importing typing costs time here); type checkers treat any
# constant of this name as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from typing import Any

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
    from ._main_job import add_run_arguments
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
    "__version__",
    "add_run_arguments",
    "checkpoint_layout",
    "create_checkpoint",
    "ensure_checkpoint",
    "executor_register_commands",
    "generate",
    "load_shard",
    "make_prompts",
    "read_config",
    "shard_range",
    "stage_layers",
    "stage_tensor_names",
    "tensor_nbytes",
]

#: The package's user-facing names, imported on first use: the registry imports this module
#: in every process (driver and workers), and most of the names below pull in torch.
_LAZY: dict[str, str] = {
    "CONFIG_METADATA_KEY": "._checkpoint",
    "Split": "._checkpoint",
    "checkpoint_layout": "._checkpoint",
    "create_checkpoint": "._checkpoint",
    "ensure_checkpoint": "._checkpoint",
    "load_shard": "._checkpoint",
    "read_config": "._checkpoint",
    "shard_range": "._checkpoint",
    "stage_tensor_names": "._checkpoint",
    "tensor_nbytes": "._checkpoint",
    "DTYPES": "._config",
    "MODEL_SIZES": "._config",
    "ModelConfig": "._config",
    "stage_layers": "._config",
    "GenerationResult": "._generate",
    "StepRecord": "._generate",
    "generate": "._generate",
    "make_prompts": "._generate",
    "add_run_arguments": "._main_job",
    "KVCache": "._model",
    "StageModel": "._model",
    "SPMD_BACKENDS": "._worker",
    "ReferenceWorker": "._worker",
    "StepInput": "._worker",
    "StepOutput": "._worker",
}

__version__ = "0.1.0"  # the one source of the distribution's version (pyproject reads it)


@hookimpl
def executor_register_commands(commands: argparse._SubParsersAction[Any]) -> None:
    """Add ``executor run``: the main job, the reference model on any backend."""
    from ._main_job import add_run_command

    add_run_command(commands)


# Hidden from type checkers, which then check every imported name against the table above.
if not TYPE_CHECKING:
    __getattr__ = lazy_getattr(__name__, _LAZY)
