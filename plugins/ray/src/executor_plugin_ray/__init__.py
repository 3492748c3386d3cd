"""executor-plugin-ray: the Ray backend (``ray``).

This module is the plugin the registry imports: it only declares the backend and must stay
cheap (it never imports Ray). The executor lives in :mod:`executor_plugin_ray._executor` and is
imported when the backend is chosen.

Its user-facing names (``RayExecutor``, ``RayOptions``, ``PlacementTimeoutError`` and
``WorkerPlacement``) import from this package and load their code on first use.
"""

from __future__ import annotations

from executor_core.backend import BackendSpec, Capabilities, hookimpl, lazy_getattr

# Not typing.TYPE_CHECKING (importing typing costs time here); type checkers treat any
# constant of this name as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._cluster import acquire_ray
    from ._executor import RayExecutor
    from ._options import RayOptions
    from ._placement import PlacementTimeoutError, WorkerPlacement

__all__ = [
    "PlacementTimeoutError",
    "RayExecutor",
    "RayOptions",
    "WorkerPlacement",
    "__version__",
    "acquire_ray",
    "executor_register_backends",
]

#: The plugin's user-facing names, imported on first use: the registry imports this module
#: in every process, and the names below pull in the backend's code.
_LAZY: dict[str, str] = {
    "PlacementTimeoutError": "._placement",
    "RayExecutor": "._executor",
    "RayOptions": "._options",
    "WorkerPlacement": "._placement",
    #: A lease on this process's Ray connection, made as the backend makes it (benchmarks).
    "acquire_ray": "._cluster",
}

__version__ = "0.1.0"  # the one source of the distribution's version (pyproject reads it)


@hookimpl
def executor_register_backends() -> list[BackendSpec]:
    """Declare the ``ray`` backend."""
    return [
        BackendSpec(
            name="ray",
            executor="executor_plugin_ray._executor:RayExecutor",
            description=(
                "One Ray actor per rank in a placement group, on one node or many; calls "
                "through shared-memory rings on the driver's node and the authenticated hub "
                "elsewhere."
            ),
            capabilities=Capabilities(
                pipeline_parallel=True,
                multi_node=True,
                devices=("cpu", "cuda"),
                recovery="replace",
                liveness_probe=True,
            ),
            requires=("ray",),
        ),
    ]


# Hidden from type checkers, which then check every imported name against the table above.
if not TYPE_CHECKING:
    __getattr__ = lazy_getattr(__name__, _LAZY)
