"""executor-plugin-ray: the Ray backend (``ray``).

This module is the plugin the registry imports: it only declares the backend and must stay
cheap (it never imports Ray). The executor lives in :mod:`executor_plugin_ray._executor` and is
imported when the backend is chosen.
"""

from __future__ import annotations

from executor_core.backend import BackendSpec, Capabilities, hookimpl

__all__ = ["__version__", "executor_register_backends"]

__version__ = "0.1.0"  # keep equal to pyproject.toml


@hookimpl
def executor_register_backends() -> list[BackendSpec]:
    """Declare the ``ray`` backend."""
    return [
        BackendSpec(
            name="ray",
            executor="executor_plugin_ray._executor:RayExecutor",
            description=(
                "One Ray actor per rank in a placement group, on one node or many; "
                "direct socket calls on one node (across nodes on request); "
                "compiled-graph execute_model on request."
            ),
            capabilities=Capabilities(
                pipeline_parallel=True, multi_node=True, devices=("cpu", "cuda")
            ),
            requires=("ray",),
        ),
    ]
