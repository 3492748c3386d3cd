"""executor-plugin-uniproc: the in-process backend (``uni``).

This module is the plugin the registry imports: it only declares the backends (``uni`` and
``external_launcher``), chosen by name (``ExecutorConfig.backend``). Their executors live in
:mod:`executor_plugin_uniproc._executor` and :mod:`executor_plugin_uniproc._external_launcher`
and are imported when chosen.
"""

from __future__ import annotations

from executor_core.backend import BackendSpec, Capabilities, hookimpl

__all__ = ["__version__", "executor_register_backends"]

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
