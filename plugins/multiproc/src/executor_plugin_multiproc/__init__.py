"""executor-plugin-multiproc: the multi-process backend (``mp``, alias ``multiproc``).

The registry imports this module in every process: it only declares the backend and the
``executor node`` command. ``MultiprocExecutor`` and ``MultiprocOptions`` load on first use.
"""

from __future__ import annotations

from executor_core.backend import BackendSpec, Capabilities, hookimpl, lazy_getattr

TYPE_CHECKING = False  # not typing's (its import costs time); checkers take it as true
if TYPE_CHECKING:
    import argparse
    from typing import Any

    from ._executor import MultiprocExecutor, MultiprocOptions

__all__ = ["MultiprocExecutor", "MultiprocOptions", "__version__", "executor_register_backends"]

_LAZY = {"MultiprocExecutor": "._executor", "MultiprocOptions": "._executor"}

__version__ = "0.1.0"  # the one source of the distribution's version (pyproject reads it)


@hookimpl
def executor_register_backends() -> list[BackendSpec]:
    """Declare the ``mp`` backend."""
    return [
        BackendSpec(
            name="mp",
            aliases=("multiproc",),
            executor="executor_plugin_multiproc._executor:MultiprocExecutor",
            description=(
                "One worker process per rank; calls broadcast through a shared-memory ring "
                "on each node, and to other nodes' agents (executor node) over "
                "authenticated TCP."
            ),
            capabilities=Capabilities(
                pipeline_parallel=True,
                multi_node=True,
                devices=("cpu", "cuda"),
                recovery="replace",
                liveness_probe=True,
            ),
        ),
    ]


@hookimpl
def executor_register_commands(commands: argparse._SubParsersAction[Any]) -> None:
    """Add ``executor node``: the agent that runs another machine's workers."""
    from ._node_cli import add_node_command

    add_node_command(commands)


# Hidden from type checkers, which then check every imported name against the table above.
if not TYPE_CHECKING:
    __getattr__ = lazy_getattr(__name__, _LAZY)
