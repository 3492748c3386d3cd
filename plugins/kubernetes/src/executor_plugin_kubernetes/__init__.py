"""executor-plugin-kubernetes: the Kubernetes backend (``k8s``, alias ``kubernetes``),
``mp``'s node agents in pods. This module, which the registry imports, only declares the
backend; ``KubernetesExecutor`` and ``KubernetesOptions`` are imported on first use."""

from __future__ import annotations

from executor_core.backend import BackendSpec, Capabilities, hookimpl, lazy_getattr

TYPE_CHECKING = False  # not typing's: importing typing costs time here
if TYPE_CHECKING:
    from ._executor import KubernetesExecutor
    from ._options import KubernetesOptions

__all__ = ["KubernetesExecutor", "KubernetesOptions", "__version__", "executor_register_backends"]

#: The plugin's user-facing names, imported on first use.
_LAZY: dict[str, str] = {"KubernetesExecutor": "._executor", "KubernetesOptions": "._options"}

__version__ = "0.1.0"  # the one source of the distribution's version (pyproject reads it)


@hookimpl
def executor_register_backends() -> list[BackendSpec]:
    """Declare the ``k8s`` backend (alias ``kubernetes``)."""
    return [
        BackendSpec(
            name="k8s",
            aliases=("kubernetes",),
            executor="executor_plugin_kubernetes._executor:KubernetesExecutor",
            description=(
                "mp's node agents in Kubernetes pods, one per node (plain pods with a "
                "headless Service, or a LeaderWorkerSet); needs a kubeconfig or an in-cluster "
                "service account allowed to manage pods, services and secrets."
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


if not TYPE_CHECKING:  # type checkers check the imported names instead
    __getattr__ = lazy_getattr(__name__, _LAZY)
