"""The objects the k8s backend creates, as the plain dicts the API takes: the channel's
``Secret``, the headless ``Service`` and one ``Pod`` per node (``shape="pods"``), or one
``LeaderWorkerSet`` group (``shape="lws"``)."""

from __future__ import annotations

import base64
from typing import Any

from ._options import KubernetesOptions

__all__ = ["AGENT", "EXECUTOR", "NODE_RANK", "SECRET_DIR", "lws", "pod", "secret", "service"]

#: Every object's label naming its executor; and the node rank of a plain pod.
EXECUTOR = "executor-sdk.io/executor"
NODE_RANK = "executor-sdk.io/node-rank"
MANAGED = {"app.kubernetes.io/managed-by": "executor-plugin-kubernetes"}
#: Where the channel's Secret is mounted (its one key, ``secret``, a file of mode 0600).
SECRET_DIR = "/var/run/executor-sdk"
#: The agent, run by the image's Python: ``executor node ...``, whose exit status 3 (no
#: driver: it was killed, or never came) becomes 0, so that ``restartPolicy: OnFailure``
#: does not start it again for nothing.
AGENT = (
    "import runpy, sys\n"
    "try:\n"
    "    runpy.run_module('executor_core', run_name='__main__', alter_sys=True)\n"
    "except SystemExit as end:\n"
    "    sys.exit(0 if end.code == 3 else end.code)\n"
)


def meta(name: str, namespace: str, labels: dict[str, str], owners: list[Any]) -> dict[str, Any]:
    """An object's metadata; ``owners``: the driver's pod, when it runs in the cluster."""
    out: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels}
    if owners:
        out["ownerReferences"] = owners
    return out


def secret(metadata: dict[str, Any], hex_key: str) -> dict[str, Any]:
    """The channel's secret, for the pods to mount as a file."""
    data = base64.b64encode(hex_key.encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata,
        "type": "Opaque",
        "data": {"secret": data},
    }


def service(metadata: dict[str, Any], selector: dict[str, str]) -> dict[str, Any]:
    """The headless Service that names each pod ``POD.SERVICE``."""
    spec = {"clusterIP": "None", "selector": selector, "publishNotReadyAddresses": True}
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata, "spec": spec}


def pod_spec(
    options: KubernetesOptions, argv: tuple[str, ...], secret_name: str, gpus: int, restart: str
) -> dict[str, Any]:
    """The spec of an agent's pod: ``argv`` (the launch's, past the driver's interpreter)
    run by the image's Python, told its pod name and address by the downward API."""
    resources: dict[str, dict[str, str]] = {k: dict(v) for k, v in options.resources.items()}
    if gpus:
        for part in ("requests", "limits"):
            resources.setdefault(part, {})["nvidia.com/gpu"] = str(gpus)
    field = [("POD_NAME", "metadata.name"), ("POD_IP", "status.podIP"), ("POD_UID", "metadata.uid")]
    env: list[dict[str, Any]] = [
        {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}} for name, path in field
    ]
    env.append({"name": "EXECUTOR_CHANNEL_SECRET_FILE", "value": f"{SECRET_DIR}/secret"})
    container: dict[str, Any] = {
        "name": "agent",
        "image": options.image,
        "command": [options.python, "-c", AGENT],
        "args": [*argv, "--node-id", "$(POD_NAME)", "--address", "$(POD_IP)"],
        "env": env,
        "volumeMounts": [{"name": "channel-secret", "mountPath": SECRET_DIR, "readOnly": True}],
    }
    if resources:
        container["resources"] = resources
    spec: dict[str, Any] = {
        "restartPolicy": restart,
        "containers": [container],
        "volumes": [
            {"name": "channel-secret", "secret": {"secretName": secret_name, "defaultMode": 0o600}}
        ],
    }
    if options.service_account:
        spec["serviceAccountName"] = options.service_account
    if options.node_selector:
        spec["nodeSelector"] = dict(options.node_selector)
    if options.tolerations:
        spec["tolerations"] = [dict(t) for t in options.tolerations]
    return spec


def pod(metadata: dict[str, Any], spec: dict[str, Any], subdomain: str) -> dict[str, Any]:
    """A plain pod, named ``POD.SUBDOMAIN`` in the cluster's DNS."""
    spec = {**spec, "hostname": metadata["name"], "subdomain": subdomain}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def lws(
    metadata: dict[str, Any], size: int, leader: dict[str, Any], worker: dict[str, Any]
) -> dict[str, Any]:
    """One LeaderWorkerSet group of ``size`` pods, each restarted alone (``None``: a pod
    that fails is not the group's end; the executor replaces what ran there)."""
    group, version, _ = ("leaderworkerset.x-k8s.io", "v1", "")
    labels = {"labels": metadata["labels"]}
    template = {
        "size": size,
        "restartPolicy": "None",
        "leaderTemplate": {"metadata": labels, "spec": leader},
        "workerTemplate": {"metadata": labels, "spec": worker},
    }
    spec = {"replicas": 1, "startupPolicy": "LeaderCreated", "leaderWorkerTemplate": template}
    return {
        "apiVersion": f"{group}/{version}",
        "kind": "LeaderWorkerSet",
        "metadata": metadata,
        "spec": spec,
    }
