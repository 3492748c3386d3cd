"""executor-cluster: an example backend on mp's launcher contract (``cluster``): a custom
scheduler places every rank's node agent; the driver runs none."""

from __future__ import annotations

from executor_core.backend import BackendSpec, Capabilities, hookimpl

__all__ = ["__version__", "executor_register_backends"]

__version__ = "0.1.0"  # the one source of the distribution's version (pyproject reads it)


@hookimpl
def executor_register_backends() -> list[BackendSpec]:
    """Declare the ``cluster`` backend (its code is imported only when it is chosen)."""
    return [
        BackendSpec(
            name="cluster",
            executor="executor_cluster._executor:ClusterExecutor",
            description="Example: mp's node agents started by a custom scheduler.",
            capabilities=Capabilities(
                pipeline_parallel=True, multi_node=True, recovery="restart", liveness_probe=True
            ),
        )
    ]
