"""executor-plugin-uniproc: the in-process backend (``uni``).

This module is the plugin the registry imports: it only declares the backend. The executor
itself lives in :mod:`executor_plugin_uniproc._executor` and is imported when chosen.

Its user-facing names (``UniProcExecutor``, ``ExternalLauncherExecutor`` and ``TORCHRUN_ENV``)
import from this package and load their code on first use.
"""

from __future__ import annotations

from executor_core.backend import BackendSpec, Capabilities, hookimpl, lazy_getattr

# Not typing.TYPE_CHECKING (importing typing costs time here); type checkers treat any
# constant of this name as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._executor import InProcessTransport, UniProcExecutor
    from ._external_launcher import TORCHRUN_ENV, ExternalLauncherExecutor

__all__ = [
    "TORCHRUN_ENV",
    "ExternalLauncherExecutor",
    "InProcessTransport",
    "UniProcExecutor",
    "__version__",
    "executor_register_backends",
]

#: The plugin's user-facing names, imported on first use: the registry imports this module
#: in every process, and the names below pull in the backend's code.
_LAZY: dict[str, str] = {
    "ExternalLauncherExecutor": "._external_launcher",
    "InProcessTransport": "._executor",
    "TORCHRUN_ENV": "._external_launcher",
    "UniProcExecutor": "._executor",
}

__version__ = "0.1.0"  # the one source of the distribution's version (pyproject reads it)


@hookimpl
def executor_register_backends() -> list[BackendSpec]:
    """Declare the ``uni`` and ``external_launcher`` backends."""
    return [
        BackendSpec(
            name="uni",
            aliases=("uniproc",),
            executor="executor_plugin_uniproc._executor:UniProcExecutor",
            description="One worker in the driver's own process; calls are direct method calls.",
            capabilities=Capabilities(devices=("cpu", "cuda"), max_world_size=1),
        ),
        BackendSpec(
            name="external_launcher",
            executor="executor_plugin_uniproc._external_launcher:ExternalLauncherExecutor",
            description="This process's own rank, in processes started by torchrun (SPMD).",
            capabilities=Capabilities(
                pipeline_parallel=True, multi_node=True, devices=("cpu", "cuda")
            ),
        ),
    ]


# Hidden from type checkers, which then check every imported name against the table above.
if not TYPE_CHECKING:
    __getattr__ = lazy_getattr(__name__, _LAZY)
