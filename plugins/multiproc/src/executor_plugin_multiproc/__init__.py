"""executor-plugin-multiproc: the multi-process backend (``mp``, alias ``multiproc``).

This module is the plugin the registry imports: it only declares the backend. The executor
lives in :mod:`executor_plugin_multiproc._executor` and is imported when chosen.
"""

from __future__ import annotations

from executor_core.backend import BackendSpec, Capabilities, hookimpl

__all__ = ["__version__", "executor_register_backends"]

__version__ = "0.1.0"  # keep equal to pyproject.toml


@hookimpl
def executor_register_backends() -> list[BackendSpec]:
    """Declare the ``mp`` backend."""
    return [
        BackendSpec(
            name="mp",
            aliases=("multiproc",),
            executor="executor_plugin_multiproc._executor:MultiprocExecutor",
            description=(
                "One worker process per rank on this machine; calls broadcast through a "
                "shared-memory ring."
            ),
            capabilities=Capabilities(pipeline_parallel=True, devices=("cpu", "cuda")),
        ),
    ]
