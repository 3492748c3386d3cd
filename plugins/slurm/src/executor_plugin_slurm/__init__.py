"""executor-plugin-slurm: the Slurm backend (``slurm``): ``mp``'s node agents run as Slurm
job steps, one per allocated node, inside this process's allocation or one it asks for.

This module, which the registry imports, only declares the backend; ``SlurmExecutor`` and
``SlurmOptions`` are imported on first use.
"""

from __future__ import annotations

from executor_core.backend import BackendSpec, Capabilities, hookimpl, lazy_getattr

# Not typing.TYPE_CHECKING (importing typing costs time here); type checkers treat any
# constant of this name as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._executor import SlurmExecutor
    from ._options import SlurmOptions

__all__ = ["SlurmExecutor", "SlurmOptions", "__version__", "executor_register_backends"]

#: The plugin's user-facing names, imported on first use.
_LAZY: dict[str, str] = {
    "SlurmExecutor": "._executor",
    "SlurmOptions": "._options",
}

__version__ = "0.1.0"  # the one source of the distribution's version (pyproject reads it)


@hookimpl
def executor_register_backends() -> list[BackendSpec]:
    """Declare the ``slurm`` backend."""
    return [
        BackendSpec(
            name="slurm",
            executor="executor_plugin_slurm._executor:SlurmExecutor",
            description=(
                "mp's node agents as Slurm job steps (srun), one per allocated node, in this "
                "process's allocation or one asked for with salloc; needs Slurm's client "
                "commands (srun, salloc, squeue, scontrol, scancel) on PATH."
            ),
            capabilities=Capabilities(
                pipeline_parallel=True,
                multi_node=True,
                devices=("cpu", "cuda"),
                recovery="replace",
                liveness_probe=True,
            ),
        )
    ]


# Hidden from type checkers, which then check every imported name against the table above.
if not TYPE_CHECKING:
    __getattr__ = lazy_getattr(__name__, _LAZY)
