"""The ``backend_options`` the k8s backend understands: mp's, and what each pod is made of,
validated into :class:`KubernetesOptions` before anything is sent to the API server."""

from __future__ import annotations

import re
from typing import Any

import attrs

from executor_core.options import boolean, number, one_of, option, optional
from executor_plugin_multiproc import MultiprocOptions

__all__ = ["KubernetesOptions"]

#: A DNS-1123 label (a namespace, a service account), a label key and value, a quantity.
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_KEY = re.compile(
    r"([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)
_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")
_TOLERATION_KEYS = {"key", "operator", "value", "effect", "tolerationSeconds"}


def _name(what: str) -> Any:
    def check(value: Any) -> str:
        if not isinstance(value, str) or not _NAME.fullmatch(value):
            raise ValueError(f"must be {what}: a DNS-1123 label like 'ml-serving'")
        return value

    return check


def _image(value: Any) -> str:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise ValueError("must be a container image reference like 'registry/app:1.0'")
    return value


def _labels(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ValueError("must be a mapping of label keys to values, like {'pool': 'gpu'}")
    for key, item in value.items():
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(f"{key!r} is not a valid label key")
        if not isinstance(item, str) or not _VALUE.fullmatch(item):
            raise ValueError(f"the value of {key!r} must be a label value (a string)")
    return dict(value)


def _tolerations(value: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list | tuple):
        raise ValueError("must be a list of tolerations, like [{'key': 'gpu'}]")
    for item in value:
        if not isinstance(item, dict) or not set(item) <= _TOLERATION_KEYS:
            raise ValueError(f"each toleration is a mapping of {sorted(_TOLERATION_KEYS)}")
        if not all(isinstance(v, str) for k, v in item.items() if k != "tolerationSeconds"):
            raise ValueError("a toleration's key, operator, value and effect are strings")
    return tuple(dict(item) for item in value)


def _resources(value: Any) -> dict[str, dict[str, str]]:
    if not isinstance(value, dict) or not set(value) <= {"requests", "limits"}:
        raise ValueError("must be a mapping of 'requests' and/or 'limits' to quantities")
    out: dict[str, dict[str, str]] = {}
    for part, amounts in value.items():
        for name, amount in amounts.items() if isinstance(amounts, dict) else [("?", None)]:
            text = amount if isinstance(amount, str) else str(amount)
            if type(amount) not in (str, int, float) or not _QUANTITY.fullmatch(text):
                raise ValueError(f"resources[{part!r}][{name!r}] must be a quantity like '16Gi'")
            out.setdefault(part, {})[str(name)] = text
    return out


@attrs.frozen(kw_only=True)
class KubernetesOptions(MultiprocOptions):
    """What ``ExecutorConfig.backend_options`` may hold for ``backend="k8s"``: every key of
    ``mp`` (:class:`~executor_plugin_multiproc.MultiprocOptions`) and the Kubernetes ones
    below. The pod count is ``ExecutorConfig.num_nodes`` (less one when the driver runs node
    0's ranks). ``KubernetesExecutor.options_cls``: the core refuses any other key."""

    #: The container image of every pod: it must hold Python with executor-core and
    #: executor-plugin-multiproc (and the worker's code) installed. Required.
    image: str | None = option(None, optional(_image))
    #: "pods": one pod per node and a headless Service (no CRD needed); "lws": one
    #: LeaderWorkerSet group of ``num_nodes`` pods (the LWS controller must be installed).
    shape: str = option("pods", one_of("pods", "lws"))
    #: The namespace; None: the kubeconfig context's, or the pod's own in the cluster.
    namespace: str | None = option(None, optional(_name("a namespace name")))
    #: The pods' service account (None: the namespace's default).
    service_account: str | None = option(None, optional(_name("a service account name")))
    #: The pods' ``nodeSelector``.
    node_selector: dict[str, str] = option({}, _labels)
    #: The pods' ``tolerations``, as Kubernetes spells them.
    tolerations: tuple[dict[str, Any], ...] = option((), _tolerations)
    #: Labels added to every object this backend creates.
    labels: dict[str, str] = option({}, _labels)
    #: The agent container's ``resources`` (``requests``/``limits``); with
    #: ``device="cuda"``, ``nvidia.com/gpu`` is set to the ranks per node.
    resources: dict[str, dict[str, str]] = option({}, _resources)
    #: The Python interpreter in the image.
    python: str = option("python3", _image)
    #: Seconds a pod may stay unscheduled or pulling before the start fails (with the
    #: scheduler's or kubelet's reason); an image that cannot be pulled fails it at once.
    pending_timeout_s: float = option(300.0, number(above=0.0))
    #: Seconds each request to the API server may take.
    api_timeout_s: float = option(10.0, number(above=0.0))
    #: The kubeconfig file (None: ``KUBECONFIG``, ``~/.kube/config``, or the in-cluster
    #: service account when ``KUBERNETES_SERVICE_HOST`` is set).
    kubeconfig: str | None = option(None, optional(_image))
    #: Whether this process runs node 0's ranks (``shape="pods"`` only): then pods are
    #: nodes 1 .. ``num_nodes - 1``.
    driver_runs_ranks: bool = option(False, boolean())
