"""The API server, through the official client (each request bounded, its failure told in
words, the checks made before anything is created), and the objects the backend sends it,
as plain dicts: the channel's ``Secret``, a headless ``Service`` and a ``Pod`` per node
(``shape="pods"``), or one ``LeaderWorkerSet`` group (``shape="lws"``)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from executor_core import ConfigError, ExecutorError

from ._options import KubernetesOptions

__all__ = ["EXECUTOR", "MANAGED", "NODE_RANK", "ApiError", "Kube", "lws", "obj", "pod_spec"]

T = TypeVar("T")
#: The LeaderWorkerSet API: (group, version, plural).
LWS = ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")
#: Every object's label naming its executor, a plain pod's node rank, the backend's mark.
EXECUTOR = "executor-sdk.io/executor"
NODE_RANK = "executor-sdk.io/node-rank"
MANAGED = {"app.kubernetes.io/managed-by": "executor-plugin-kubernetes"}
#: Where the channel's Secret is mounted (its one key, ``secret``, a file of mode 0600).
SECRET_DIR = "/var/run/executor-sdk"
_IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
#: What the backend does: (group, resource, verbs); the last with shape="lws" only.
_RULES = [("", "pods", "create get list delete"), ("", "secrets", "create delete"),
          ("", "services", "create delete"), ("", "events", "list"),
          (LWS[0], LWS[2], "create get delete")]  # fmt: skip
#: The agent, run by the image's Python: its exit status 3 (no driver: killed, or it never
#: came) becomes 0, so that ``restartPolicy: OnFailure`` does not start it again for nothing.
AGENT = "import runpy, sys\ntry:\n    runpy.run_module('executor_core', run_name='__main__', \
alter_sys=True)\nexcept SystemExit as end:\n    sys.exit(0 if end.code == 3 else end.code)\n"


class Kube:
    """The clients of one executor, for one namespace (:attr:`namespace`)."""

    def __init__(self, options: KubernetesOptions) -> None:
        from kubernetes import client
        from kubernetes import config as untyped

        config: Any = untyped  # its loaders are not typed
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
        configuration.retries = 0  # an answer or an error
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
            try:
                message = str(json.loads(exc.body or "")["message"])
            except (TypeError, ValueError, KeyError):
                message = str(exc.reason)
            raise ApiError(what, exc.status or 0, message) from None
        except HTTPError as exc:
            raise ExecutorError(
                f"the Kubernetes API server at {self.host} did not answer ({what}): {exc}"
            ) from None

    def create(self, body: dict[str, Any]) -> None:
        """Create the object ``body`` in the namespace."""
        kind, ns, what = body["kind"], self.namespace, f"creating {body['kind']}"
        if kind == "LeaderWorkerSet":
            what += " (is the LWS controller installed?)"
            self.call(what, self.custom.create_namespaced_custom_object, *LWS[:2], ns, LWS[2], body)
        else:
            self.call(what, getattr(self.core, f"create_namespaced_{kind.lower()}"), ns, body)

    def delete(self, kind: str, name: str, **kwargs: Any) -> None:
        """Delete an object (``pod``, ``service``, ``secret``, ``LeaderWorkerSet``), if there."""
        custom, ns = self.custom.delete_namespaced_custom_object, self.namespace
        with contextlib.suppress(ApiError):
            if kind == "LeaderWorkerSet":
                self.call(f"deleting {kind}", custom, *LWS[:2], ns, LWS[2], name, **kwargs)
            else:
                delete = getattr(self.core, f"delete_namespaced_{kind}")
                self.call(f"deleting {kind} {name}", delete, name, ns, **kwargs)

    def pod(self, name: str) -> Any:
        """The pod ``name``, or None if there is none."""
        try:
            return self.call(f"reading {name}", self.core.read_namespaced_pod, name, self.namespace)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def pods(self, labels: dict[str, str]) -> list[Any]:
        """The pods with ``labels``."""
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        found = self.call("listing pods", self.core.list_namespaced_pod, self.namespace,
                          label_selector=selector)  # fmt: skip
        return list(found.items)

    def warnings(self, name: str) -> str:
        """The last warnings about object ``name`` (the scheduler's, the kubelet's)."""
        with contextlib.suppress(ExecutorError):
            events = self.call(
                "reading events", self.core.list_namespaced_event, self.namespace,
                field_selector=f"involvedObject.name={name}",
            ).items  # fmt: skip
            warned = [f"{e.reason}: {e.message}" for e in events if e.type == "Warning"][-3:]
            if warned:
                return "; events: " + " | ".join(warned)
        return ""

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
        for group, resource, verbs in _RULES[: 5 if lws else 4]:
            for verb in verbs.split():
                attributes = {"namespace": ns, "verb": verb, "group": group, "resource": resource}
                review = obj("SelfSubjectAccessReview", {}, spec={"resourceAttributes": attributes})
                review["apiVersion"] = "authorization.k8s.io/v1"
                create = self.authz.create_self_subject_access_review
                if not getattr(
                    self.call("checking permissions", create, review).status, "allowed", 0
                ):
                    missing.append(f"{verb} {resource}{'.' + group if group else ''}")
        if missing:
            raise ExecutorError(
                f"the k8s backend may not {', '.join(missing)} in namespace {ns!r}: grant them "
                "to this identity (a Role and RoleBinding; see docs/kubernetes.md)"
            )

    def close(self) -> None:
        """Close the client's connections."""
        self._client.close()  # type: ignore[no-untyped-call]


class ApiError(ExecutorError):
    """A request the API server refused: its HTTP ``status`` and message."""

    def __init__(self, what: str, status: int, message: str) -> None:
        super().__init__(f"{what}: the Kubernetes API said {status}: {message}")
        #: The HTTP status (404: not found, 403: forbidden, 409: exists).
        self.status = status


def obj(kind: str, metadata: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """An object of ``kind`` (of the core API, or a LeaderWorkerSet) with ``fields``."""
    api = f"{LWS[0]}/{LWS[1]}" if kind == "LeaderWorkerSet" else "v1"
    return {"apiVersion": api, "kind": kind, "metadata": metadata, **fields}


def pod_spec(
    options: KubernetesOptions, argv: tuple[str, ...], secret_name: str, gpus: int, restart: str
) -> dict[str, Any]:
    """The spec of an agent's pod: ``argv`` (the launch's, past the driver's interpreter)
    run by the image's Python, told its pod name and address by the downward API; the
    channel's Secret mounted as a file of mode 0600; ``nvidia.com/gpu`` = ``gpus``."""
    resources: dict[str, dict[str, str]] = {k: dict(v) for k, v in options.resources.items()}
    for part in ("requests", "limits") if gpus else ():
        resources.setdefault(part, {})["nvidia.com/gpu"] = str(gpus)
    field = [("POD_NAME", "metadata.name"), ("POD_IP", "status.podIP"), ("POD_UID", "metadata.uid")]
    env: list[dict[str, Any]] = [
        {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}} for name, path in field
    ]
    env.append({"name": "EXECUTOR_CHANNEL_SECRET_FILE", "value": f"{SECRET_DIR}/secret"})
    container: dict[str, Any] = {
        "name": "agent", "image": options.image, "command": [options.python, "-c", AGENT],
        "args": [*argv, "--node-id", "$(POD_NAME)", "--address", "$(POD_IP)"], "env": env,
        "volumeMounts": [{"name": "channel-secret", "mountPath": SECRET_DIR, "readOnly": True}],
    }  # fmt: skip
    if resources:
        container["resources"] = resources
    volume = {"name": "channel-secret", "secret": {"secretName": secret_name, "defaultMode": 0o600}}
    spec: dict[str, Any] = {"restartPolicy": restart, "volumes": [volume]}
    spec["containers"] = [container]
    if options.service_account:
        spec["serviceAccountName"] = options.service_account
    if options.node_selector:
        spec["nodeSelector"] = dict(options.node_selector)
    if options.tolerations:
        spec["tolerations"] = [dict(t) for t in options.tolerations]
    return spec


def lws(
    metadata: dict[str, Any], size: int, leader: dict[str, Any], worker: dict[str, Any]
) -> dict[str, Any]:
    """One LeaderWorkerSet group of ``size`` pods, each restarted alone (``None``: a pod
    that fails is not the group's end; the executor recovers what ran there)."""
    labels = {"labels": metadata["labels"]}
    template = {"size": size, "restartPolicy": "None",
                "leaderTemplate": {"metadata": labels, "spec": leader},
                "workerTemplate": {"metadata": labels, "spec": worker}}  # fmt: skip
    spec = {"replicas": 1, "startupPolicy": "LeaderCreated", "leaderWorkerTemplate": template}
    return obj("LeaderWorkerSet", metadata, spec=spec)
