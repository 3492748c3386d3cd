"""executor-threads: an example third-party backend, one worker per thread (``threads``)."""

from __future__ import annotations

from executor_core.backend import BackendSpec, Capabilities, hookimpl

__all__ = ["__version__", "executor_register_backends"]

__version__ = "0.1.0"  # the one source of the distribution's version (pyproject reads it)


@hookimpl
def executor_register_backends() -> list[BackendSpec]:
    """Declare the ``threads`` backend (its code is imported only when it is chosen)."""
    return [
        BackendSpec(
            name="threads",
            executor="executor_threads._executor:ThreadExecutor",
            description="Example: one worker per thread in the driver's process.",
            capabilities=Capabilities(pipeline_parallel=True),
        )
    ]
