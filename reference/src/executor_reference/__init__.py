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

    from ._checkpoint import ensure_checkpoint
    from ._config import MODEL_SIZES, ModelConfig
    from ._generate import generate, make_prompts
    from ._main_job import add_run_arguments
    from ._result import GenerationResult
    from ._step import StepInput, StepOutput
    from ._worker import ReferenceWorker

__all__ = [
    "MODEL_SIZES",
    "GenerationResult",
    "ModelConfig",
    "ReferenceWorker",
    "StepInput",
    "StepOutput",
    "__version__",
    "add_run_arguments",
    "ensure_checkpoint",
    "executor_register_commands",
    "generate",
    "make_prompts",
]

#: The package's user-facing names, imported on first use: the registry imports this module
#: in every process (driver and workers), and most of the names below pull in torch.
_LAZY: dict[str, str] = {
    "ensure_checkpoint": "._checkpoint",
    "MODEL_SIZES": "._config",
    "ModelConfig": "._config",
    "GenerationResult": "._result",
    "generate": "._generate",
    "make_prompts": "._generate",
    "add_run_arguments": "._main_job",
    "ReferenceWorker": "._worker",
    "StepInput": "._step",
    "StepOutput": "._step",
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
