"""The API server, through the official client: configuration, each request bounded and
its failure told in words (the status, the verb and the resource), and the checks made
before anything is created (reachable, the namespace exists, every permission held)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from executor_core import ConfigError, ExecutorError

from ._options import KubernetesOptions

__all__ = ["LWS", "Kube"]

T = TypeVar("T")
#: The LeaderWorkerSet API: (group, version, plural).
LWS = ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")
_IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
#: What the backend does, per shape: (verb, group, resource).
_CORE = [
    *((verb, "", "pods") for verb in ("create", "get", "list", "delete")),
    *((verb, "", kind) for verb in ("create", "delete") for kind in ("secrets", "services")),
    ("list", "", "events"),
]
_LWS = [(verb, LWS[0], LWS[2]) for verb in ("create", "get", "delete")]


class Kube:
    """The clients of one executor, for one namespace (``namespace``)."""

    def __init__(self, options: KubernetesOptions) -> None:
        from kubernetes import client, config

        self.timeout = options.api_timeout_s
        configuration = client.Configuration()
        namespace = options.namespace
        try:
            if options.kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config(client_configuration=configuration)
                if namespace is None and _IN_CLUSTER_NAMESPACE.is_file():
                    namespace = _IN_CLUSTER_NAMESPACE.read_text().strip()
            else:
                config.load_kube_config(options.kubeconfig, client_configuration=configuration)
                if namespace is None:
                    _, active = config.list_kube_config_contexts(options.kubeconfig)
                    namespace = active.get("context", {}).get("namespace")
        except (config.ConfigException, OSError, TypeError) as exc:
            raise ExecutorError(
                f"the k8s backend found no Kubernetes API server to talk to: {exc} (give a "
                "kubeconfig: KUBECONFIG, ~/.kube/config or backend_options['kubeconfig'], or "
                "run in a pod with a service account)"
            ) from None
        configuration.retries = 0  # type: ignore[attr-defined]  # an answer or an error
        self.host = configuration.host
        #: The namespace every object goes into.
        self.namespace: str = namespace or "default"
        self._client = client.ApiClient(configuration)
        self.core = client.CoreV1Api(self._client)
        self.custom = client.CustomObjectsApi(self._client)
        self.authz = client.AuthorizationV1Api(self._client)

    def call(self, what: str, request: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``request(*args, **kwargs)`` bounded by ``api_timeout_s``; an ``ExecutorError``
        saying ``what`` failed and why (the API's status and message)."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return request(*args, _request_timeout=self.timeout, **kwargs)
        except ApiException as exc:
            raise ApiError(what, exc.status or 0, _message(exc)) from None
        except HTTPError as exc:
            raise ExecutorError(
                f"the Kubernetes API server at {self.host} did not answer ({what}): {exc}"
            ) from None

    def preflight(self, lws: bool) -> None:
        """Before anything is created: the server answers, the namespace exists, and this
        identity may do all the backend does (a SelfSubjectAccessReview per permission)."""
        ns = self.namespace
        try:
            self.call(f"reading namespace {ns!r}", self.core.read_namespace, ns)
        except ApiError as exc:
            if exc.status == 404:
                raise ConfigError(
                    "backend_options", {"namespace": ns}, "no such namespace in the cluster"
                ) from None
            if exc.status != 403:  # reading namespaces is a cluster permission: not required
                raise
        missing = []
        for verb, group, resource in [*_CORE, *(_LWS if lws else [])]:
            review = {
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SelfSubjectAccessReview",
                "spec": {
                    "resourceAttributes": {
                        "namespace": ns,
                        "verb": verb,
                        "group": group,
                        "resource": resource,
                    }
                },
            }
            answer = self.call(
                "checking permissions", self.authz.create_self_subject_access_review, review
            )
            if not answer.status.allowed:
                missing.append(f"{verb} {resource}{'.' + group if group else ''}")
        if missing:
            raise ExecutorError(
                f"the k8s backend may not {', '.join(missing)} in namespace {ns!r}: grant them "
                "to this identity (a Role and RoleBinding; see docs/kubernetes.md)"
            )

    def close(self) -> None:
        """Close the client's connections."""
        self._client.close()


class ApiError(ExecutorError):
    """A request the API server refused: its HTTP ``status`` and message."""

    def __init__(self, what: str, status: int, message: str) -> None:
        super().__init__(f"{what}: the Kubernetes API said {status}: {message}")
        #: The HTTP status (404: not found, 403: forbidden, 409: exists).
        self.status = status


def _message(exc: Any) -> str:
    import json

    try:
        return str(json.loads(exc.body)["message"])
    except (TypeError, ValueError, KeyError):
        return str(exc.reason)
