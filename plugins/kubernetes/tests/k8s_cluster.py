"""A Kubernetes of the tests' own, on this machine: an API server (real HTTP, the routes and
JSON the backend's official client uses: pods, services, secrets, events, namespaces,
selfsubjectaccessreviews and LeaderWorkerSets) and a kubelet that schedules each pod and
runs its container's command as a local process at its own loopback address (127.0.0.x),
with the pod's environment (the downward API too, ``$(VAR)`` expanded) and its Secret volume
written as files of the volume's ``defaultMode`` under a root of the pod's own (the
environment's paths under the mount are mapped there). It reports phase, exit code and
reason, restarts per ``restartPolicy`` (with a back-off, ``CrashLoopBackOff``), and acts as
the LWS controller and the garbage collector (``ownerReferences``).

Test hooks: a ``nodeSelector`` no node matches leaves a pod ``Unschedulable`` with the
scheduler's message; an image whose name starts with ``unpullable/`` is never pulled
(``ErrImagePull``, then ``ImagePullBackOff``); :meth:`Cluster.kill` kills a pod's
container (``Error``, or ``OOMKilled``); :meth:`Cluster.evict` evicts a pod; ``denied``
holds the permissions ``(verb, resource)`` a SelfSubjectAccessReview refuses.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

NODE_LABELS = {"kubernetes.io/os": "linux", "executor-test/pool": "cpu"}
_ROUTE = re.compile(
    r"/api(?:s/(?P<group>[^/]+))?/v1/namespaces/(?P<ns>[^/]+)(?:/(?P<kind>[a-z]+)(?:/(?P<name>[^/]+))?)?"
)
_LWS_NAME = "leaderworkerset.sigs.k8s.io/name"
_LWS_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"


def _stamp() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Cluster:
    """The API server (at :attr:`url`) and its kubelet; :meth:`close` ends both and every
    container process."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.namespaces = {"default", "ml"}
        #: (kind, namespace, name) -> object, as the API would return it.
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        #: Every body POSTed to the server (the manifests the backend sent).
        self.sent: list[dict[str, Any]] = []
        self.denied: set[tuple[str, str]] = set()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}  # pod uid -> its container
        self._oom: set[str] = set()
        self._ips = iter(range(10, 250))
        self.root = Path(tempfile.mkdtemp(prefix="k8s-test-"))
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True),
            threading.Thread(target=self._kubelet, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def kubeconfig(self, path: Path, namespace: str = "default", url: str | None = None) -> Path:
        """A kubeconfig for this server (the client reads it as it would any)."""
        context = {"cluster": "test", "user": "test", "namespace": namespace}
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": url or self.url}}],
            "contexts": [{"name": "test", "context": context}],
            "users": [{"name": "test", "user": {"token": "test-token"}}],
        }))  # fmt: skip
        return path

    def pods(self) -> dict[str, dict[str, Any]]:
        """Every pod, by name."""
        with self.lock:
            return {n: copy.deepcopy(o) for (k, _, n), o in self.objects.items() if k == "pods"}

    def kinds(self) -> list[tuple[str, str]]:
        """(kind, name) of every object left."""
        with self.lock:
            return sorted((k, n) for k, _, n in self.objects)

    def pid(self, pod: str) -> int:
        """The pid of a running pod's container."""
        with self.lock:
            return self.procs[self.pods()[pod]["metadata"]["uid"]].pid

    def kill(self, pod: str, oom: bool = False) -> None:
        """Kill the pod's container (SIGKILL), as a crash or the OOM killer would."""
        with self.lock:
            uid = self.pods()[pod]["metadata"]["uid"]
            if oom:
                self._oom.add(uid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.procs[uid].pid, signal.SIGKILL)

    def evict(self, pod: str) -> None:
        """Evict the pod (the kubelet under memory pressure): Failed, Evicted, killed."""
        with self.lock:
            obj = self.objects[("pods", self.pods()[pod]["metadata"]["namespace"], pod)]
            obj["status"].update(
                phase="Failed", reason="Evicted", message="The node was low on resource: memory."
            )
            self._end(obj)

    def close(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
        for thread in self._threads:
            thread.join(10)
        with self.lock:
            for obj in [o for (k, _, _), o in self.objects.items() if k == "pods"]:
                self._end(obj)
        shutil.rmtree(self.root, ignore_errors=True)

    # --- the API -----------------------------------------------------------------------

    def create(self, kind: str, ns: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self.lock:
            self.sent.append(copy.deepcopy(body))
            if ns not in self.namespaces:
                return 404, _status(404, f'namespaces "{ns}" not found')
            name = body["metadata"]["name"]
            if (kind, ns, name) in self.objects:
                return 409, _status(409, f'{kind} "{name}" already exists')
            meta = body["metadata"]
            meta.update(
                uid=str(uuid.uuid4()), creationTimestamp=_stamp(), resourceVersion="1", namespace=ns
            )
            if kind == "pods":
                body["status"] = {"phase": "Pending"}
            self.objects[(kind, ns, name)] = body
            return 201, body

    def delete(
        self, kind: str, ns: str, name: str, grace: int | None
    ) -> tuple[int, dict[str, Any]]:
        with self.lock:
            obj = self.objects.get((kind, ns, name))
            if obj is None:
                return 404, _status(404, f'{kind} "{name}" not found')
            self._remove(kind, ns, name, grace == 0)
            return 200, obj

    def _remove(self, kind: str, ns: str, name: str, now: bool) -> None:
        obj = self.objects[(kind, ns, name)]
        if kind == "pods" and not now:
            obj["metadata"].setdefault("deletionTimestamp", _stamp())  # the kubelet ends it
        else:
            self._end(obj)
            del self.objects[(kind, ns, name)]
        uid = obj["metadata"]["uid"]
        for key, other in list(self.objects.items()):  # the garbage collector
            owned = any(r["uid"] == uid for r in other["metadata"].get("ownerReferences", []))
            if owned and key in self.objects and "deletionTimestamp" not in other["metadata"]:
                self._remove(*key, now=False)

    def list(self, kind: str, ns: str, query: dict[str, list[str]]) -> dict[str, Any]:
        labels = dict(p.split("=", 1) for p in query.get("labelSelector", [""])[0].split(",") if p)
        fields = dict(p.split("=", 1) for p in query.get("fieldSelector", [""])[0].split(",") if p)
        with self.lock:
            if kind == "events":
                items = [e for e in self.events if e["metadata"]["namespace"] == ns]
                name = fields.get("involvedObject.name")
                items = [e for e in items if name is None or e["involvedObject"]["name"] == name]
            else:
                items = [
                    o for (k, n, _), o in self.objects.items()
                    if (k, n) == (kind, ns)
                    and labels.items() <= o["metadata"].get("labels", {}).items()
                ]  # fmt: skip
            return {
                "apiVersion": "v1",
                "kind": "List",
                "metadata": {},
                "items": copy.deepcopy(items),
            }

    def review(self, body: dict[str, Any]) -> dict[str, Any]:
        attrs = body["spec"]["resourceAttributes"]
        allowed = (attrs["verb"], attrs["resource"]) not in self.denied
        return {**body, "status": {"allowed": allowed}}

    def event(self, pod: dict[str, Any], reason: str, message: str) -> None:
        meta, ns = pod["metadata"], pod["metadata"]["namespace"]
        self.events.append({
            "metadata": {"name": f"{meta['name']}.{len(self.events)}", "namespace": ns},
            "involvedObject": {"kind": "Pod", "name": meta["name"], "namespace": meta["namespace"]},
            "reason": reason, "message": message, "type": "Warning",
        })  # fmt: skip

    # --- the kubelet, the scheduler, the LWS controller ------------------------------------

    def _kubelet(self) -> None:
        while not self._stop.wait(0.05):
            with self.lock:
                for (kind, ns, name), obj in list(self.objects.items()):
                    if kind == "leaderworkersets" and not obj.get("made"):
                        obj["made"] = True
                        self._lws_pods(ns, obj)
                    elif kind == "pods":
                        self._sync(ns, name, obj)

    def _lws_pods(self, ns: str, lws: dict[str, Any]) -> None:
        template, name = lws["spec"]["leaderWorkerTemplate"], lws["metadata"]["name"]
        owner = {
            "apiVersion": lws["apiVersion"],
            "kind": "LeaderWorkerSet",
            "name": name,
            "uid": lws["metadata"]["uid"],
        }
        for index in range(template["size"]):
            part = copy.deepcopy(template["leaderTemplate" if index == 0 else "workerTemplate"])
            labels = {**part["metadata"].get("labels", {}), _LWS_NAME: name, _LWS_INDEX: str(index)}
            for container in part["spec"]["containers"]:
                container.setdefault("env", []).append(
                    {"name": "LWS_WORKER_INDEX", "value": str(index)}
                )
            pod = f"{name}-0" + (f"-{index}" if index else "")
            meta = {"name": pod, "labels": labels, "ownerReferences": [owner]}
            self.create(
                "pods",
                ns,
                {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": part["spec"]},
            )
            self.sent.pop()  # the controller's, not the backend's

    def _sync(self, ns: str, name: str, pod: dict[str, Any]) -> None:
        status, spec, uid = pod["status"], pod["spec"], pod["metadata"]["uid"]
        if "deletionTimestamp" in pod["metadata"]:
            self._end(pod)
            del self.objects[("pods", ns, name)]
            return
        if status["phase"] in ("Succeeded", "Failed"):
            return
        if "podIP" not in status:
            if not spec.get("nodeSelector", {}).items() <= NODE_LABELS.items():
                if not status.get("conditions"):
                    message = (
                        "0/2 nodes are available: 2 node(s) didn't match Pod's node affinity/"
                        "selector. preemption: 0/2 nodes are available: 2 Preemption is not "
                        "helpful for scheduling."
                    )
                    status["conditions"] = [
                        {
                            "type": "PodScheduled",
                            "status": "False",
                            "reason": "Unschedulable",
                            "message": message,
                        }
                    ]
                    self.event(pod, "FailedScheduling", message)
                return
            status.update(
                podIP=f"127.0.0.{next(self._ips)}", hostIP="127.0.0.1", startTime=_stamp()
            )
            status["conditions"] = [{"type": "PodScheduled", "status": "True"}]
            spec["nodeName"] = "node-1"
        container = spec["containers"][0]
        fresh = {"name": container["name"], "restartCount": 0, "state": {},
                 "image": container["image"], "imageID": "", "ready": False}  # fmt: skip
        cs = status.setdefault("containerStatuses", [fresh])[0]
        if container["image"].startswith("unpullable/"):
            if not cs["state"]:
                self.event(pod, "Failed", f'Failed to pull image "{container["image"]}": not found')
                cs["state"] = {"waiting": {"reason": "ErrImagePull", "message": "not found"}}
            else:
                cs["state"] = {
                    "waiting": {
                        "reason": "ImagePullBackOff",
                        "message": f'Back-off pulling image "{container["image"]}"',
                    }
                }
            return
        proc = self.procs.get(uid)
        if proc is None:
            waiting = cs["state"].get("waiting", {})
            if waiting.get("until", 0) <= time.monotonic():
                self._run(pod, container, cs)
            return
        code = proc.poll()
        if code is None:
            return
        del self.procs[uid]
        reason = "OOMKilled" if uid in self._oom else ("Completed" if code == 0 else "Error")
        self._oom.discard(uid)
        exit_code = 128 - code if code < 0 else code
        cs["lastState"] = {
            "terminated": {"exitCode": exit_code, "reason": reason, "finishedAt": _stamp()}
        }
        policy = spec.get("restartPolicy", "Always")
        if policy == "Always" or (policy == "OnFailure" and exit_code):
            backoff = min(2.0 ** cs["restartCount"] * 0.5, 5.0)
            message = f"back-off {backoff:g}s restarting failed container"
            until = time.monotonic() + backoff
            waiting = {"reason": "CrashLoopBackOff", "message": message, "until": until}
            cs["state"] = {"waiting": waiting}
        else:
            cs["state"], cs["lastState"] = {"terminated": cs.pop("lastState")["terminated"]}, {}
            status["phase"] = "Succeeded" if exit_code == 0 else "Failed"

    def _run(self, pod: dict[str, Any], container: dict[str, Any], cs: dict[str, Any]) -> None:
        root = self.root / pod["metadata"]["uid"]
        mounts: dict[str, str] = {}
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        for mount in container.get("volumeMounts", []):
            secret = volumes[mount["name"]]["secret"]
            where = root / mount["mountPath"].lstrip("/")
            where.mkdir(parents=True, exist_ok=True)
            obj = self.objects[("secrets", pod["metadata"]["namespace"], secret["secretName"])]
            for key, value in obj["data"].items():
                path = where / key
                path.write_bytes(__import__("base64").b64decode(value))
                path.chmod(secret.get("defaultMode", 0o644))
            mounts[mount["mountPath"]] = str(where)
        fields = {
            "metadata.name": pod["metadata"]["name"],
            "metadata.uid": pod["metadata"]["uid"],
            "status.podIP": pod["status"]["podIP"],
        }
        env: dict[str, str] = {}
        for item in container.get("env", []):
            value = (
                item["value"]
                if "value" in item
                else fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
            )
            for path, local in mounts.items():
                value = value.replace(path, local) if value.startswith(path) else value
            env[item["name"]] = value

        def expand(s):
            return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), s)

        argv = [expand(a) for a in [*container["command"], *container.get("args", [])]]
        base = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("KUBECONFIG", "POD_", "EXECUTOR_CHANNEL"))
        }
        base["PATH"] = f"{Path(sys.executable).parent}:{base.get('PATH', '')}"
        self.procs[pod["metadata"]["uid"]] = subprocess.Popen(
            argv, env={**base, **env}, stdin=subprocess.DEVNULL, start_new_session=True
        )
        if cs["state"].get("waiting", {}).get("reason") == "CrashLoopBackOff":
            cs["restartCount"] += 1
        cs["state"] = {"running": {"startedAt": _stamp()}}
        pod["status"]["phase"] = "Running"

    def _end(self, pod: dict[str, Any]) -> None:
        proc = self.procs.pop(pod["metadata"]["uid"], None)
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(2.0)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5.0)
        shutil.rmtree(self.root / pod["metadata"]["uid"], ignore_errors=True)


def _status(code: int, message: str) -> dict[str, Any]:
    reason = {403: "Forbidden", 404: "NotFound", 409: "AlreadyExists"}.get(code, "Unknown")
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _handler(cluster: Cluster) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet."""

        def _answer(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict[str, Any]:
            size = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(size) or b"{}")  # type: ignore[no-any-return]

        def _route(self, method: str) -> None:
            url = urlparse(self.path)
            body = self._body() if method in ("POST", "DELETE") else {}
            if url.path == "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews":
                return self._answer(201, cluster.review(body))
            found = _ROUTE.fullmatch(url.path)
            if found is None:
                return self._answer(404, _status(404, f"no route {url.path}"))
            ns, kind, name = found["ns"], found["kind"], found["name"]
            if kind is None:
                known = ns in cluster.namespaces
                meta = {"name": ns}
                return (
                    self._answer(200, {"apiVersion": "v1", "kind": "Namespace", "metadata": meta})
                    if known
                    else self._answer(404, _status(404, f'namespaces "{ns}" not found'))
                )
            if method == "POST":
                return self._answer(*cluster.create(kind, ns, body))
            if method == "DELETE":
                grace = body.get(
                    "gracePeriodSeconds", parse_qs(url.query).get("gracePeriodSeconds", [None])[0]
                )
                return self._answer(
                    *cluster.delete(kind, ns, name, None if grace is None else int(grace))
                )
            if name is None:
                return self._answer(200, cluster.list(kind, ns, parse_qs(url.query)))
            with cluster.lock:
                obj = cluster.objects.get((kind, ns, name))
                if obj is None:
                    return self._answer(404, _status(404, f'{kind} "{name}" not found'))
                return self._answer(200, copy.deepcopy(obj))

        def do_GET(self) -> None:
            self._route("GET")

        def do_POST(self) -> None:
            self._route("POST")

        def do_DELETE(self) -> None:
            self._route("DELETE")

    return Handler
