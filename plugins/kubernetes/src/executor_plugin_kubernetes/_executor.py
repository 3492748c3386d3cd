"""The ``k8s`` backend: ``mp``'s executor whose node agents run in pods, one per node (see
:class:`KubernetesPlacement`). Everything but where the agents run (admission, heartbeats,
recovery, every rule of a call) is ``mp``'s.
"""

from __future__ import annotations

import base64
import datetime
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any, ClassVar

from executor_channel import Secret
from executor_core import ConfigError, ExecutorConfig, ExecutorError
from executor_plugin_multiproc import MultiprocExecutor, MultiprocOptions
from executor_plugin_multiproc.launcher import AgentLaunch, Placement

from . import _kube as k
from ._options import KubernetesOptions

__all__ = ["KubernetesExecutor", "KubernetesPlacement"]

logger = logging.getLogger("executor_plugin_kubernetes")

#: A container waiting for one of these will not start by itself.
_STUCK = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
          "CreateContainerError", "CrashLoopBackOff", "RunContainerError"}  # fmt: skip
#: Seconds between two looks at the pods after the start (one request each).
_WATCH_S = 0.1
#: Seconds a lost node's error waits for Kubernetes to say why its pod ended.
_EXPLAIN_S = 3.0
#: Seconds a deleted pod may take to go before it is force-deleted.
_GONE_S = 20.0


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def said(pod: Any, since: datetime.datetime) -> tuple[str, bool]:
    """What Kubernetes says of ``pod`` (the kubelet's and the scheduler's reasons), and
    whether it cannot run now (a container's end after ``since`` counts; an older one was
    seen and recovered already)."""
    status, name = pod.status, pod.metadata.name
    if pod.metadata.deletion_timestamp is not None:
        return f"pod {name} is being deleted", True
    if status.phase in ("Failed", "Succeeded"):
        why = f" ({status.reason}: {status.message})" if status.reason else ""
        return f"pod {name} {status.phase}{why}", True
    for c in status.container_statuses or []:
        done = c.state.terminated or (c.last_state and c.last_state.terminated)
        ended = f"exit code {done.exit_code}, reason {done.reason}" if done else ""
        recent = bool(done) and (done.finished_at is None or done.finished_at > since)
        waiting = c.state.waiting
        if waiting is not None and waiting.reason in _STUCK:
            last = f" (last run: {ended})" if ended else ""
            return f"{waiting.reason}: {waiting.message}{last}", recent or (
                waiting.reason != "CrashLoopBackOff"
            )
        if recent:
            return f"container {c.name} ended: {ended}", True
    for cond in status.conditions or []:
        if cond.type == "DisruptionTarget" and cond.status == "True":
            return f"{cond.reason}: {cond.message}", True
        if cond.type == "PodScheduled" and cond.status == "False":
            return f"{cond.reason}: {cond.message}", False
    return "", False


class KubernetesPlacement(Placement):
    """Creates, at the first start, the channel's ``Secret`` and either a headless
    ``Service`` and a pod per node (``shape="pods"``) or a ``LeaderWorkerSet`` of
    ``num_nodes`` pods (``shape="lws"``), each running that node's ``executor node``. A pod
    is restarted alone (its own restart policy, never the group's): its agent joins again in
    its lost one's place, where only its ranks are replaced. A pod that cannot start fails
    the start with Kubernetes' reason; one that dies later is reported with it
    (``agent_lost``, :meth:`explain`). With ``backend_options['driver_runs_ranks']`` this
    process runs node 0's ranks and the pods are nodes 1 .. ``num_nodes - 1``."""

    agents_rejoin: ClassVar[bool] = True

    def __init__(self, config: ExecutorConfig, options: MultiprocOptions) -> None:
        super().__init__(config, options)
        assert isinstance(options, KubernetesOptions)  # KubernetesExecutor's options_cls
        if options.image is None:
            raise ConfigError("backend_options", {"image": None}, "the pods need an image")
        if options.driver_runs_ranks and options.shape == "lws":
            raise ConfigError(
                "backend_options",
                {"driver_runs_ranks": True, "shape": "lws"},
                "a LeaderWorkerSet group is every node: the driver runs outside it",
            )
        self.driver_runs_ranks = options.driver_runs_ranks  # type: ignore[misc]  # per executor
        self.k8s = options
        self.kube = kube = k.Kube(options)
        #: This executor's name: of its Secret, Service, LWS, and in every object's label.
        self.name = f"executor-{secrets.token_hex(4)}"
        self.labels = {**options.labels, **k.MANAGED, k.EXECUTOR: self.name}
        self.owners = _driver_pod(kube.namespace)
        self._port = 0
        self._secret: Secret | None = None
        self._asked = _now()  # when the current incarnation's pods were asked for
        self._names: dict[int, str] = {}  # node rank -> its pod
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        try:
            kube.preflight(options.shape == "lws")
            self._sweep()
        except BaseException:
            kube.close()
            raise

    def explain(self, node_rank: int) -> str:
        """Kubernetes' reason for the end of ``node_rank``'s pod, awaited for at most
        ``_EXPLAIN_S`` (a kubelet reports a container's end within a second or two)."""
        name = self._names.get(node_rank)
        deadline = time.monotonic() + _EXPLAIN_S
        while name is not None and time.monotonic() < deadline:
            pod = self.kube.pod(name)
            what, fatal = said(pod, self._asked) if pod else (f"pod {name} is gone", True)
            if fatal:  # as the watcher tells it (the SDK adds it to an error once)
                return f"Kubernetes: {what}"
            time.sleep(_WATCH_S)
        return ""

    def node_id(self) -> str:
        return os.environ.get("POD_NAME") or super().node_id()

    def secret(self) -> Secret:
        # One per executor, not per incarnation: surviving agents rejoin holding it.
        if self._secret is None:
            self._secret = Secret.generate()
        return self._secret

    def port(self) -> int:
        # Fixed for the executor's life: surviving agents rejoin at the same address.
        if not self._port:
            with socket.socket() as probe:
                probe.bind((self.config.distributed_host, 0))
                self._port = probe.getsockname()[1]
        return self._port

    def start(self, launch: AgentLaunch) -> None:
        self._asked, rank = _now(), launch.node_rank
        config = self.config  # argv: past the driver's "python -m executor_core"
        args = launch.argv[3:]
        gpus = config.world_size // config.num_nodes if config.device == "cuda" else 0
        if self._watcher is None:  # the first start: what every incarnation shares
            data = {"secret": base64.b64encode(launch.secret.hex().encode()).decode()}
            self.kube.create(k.obj("Secret", self._meta(self.name), type="Opaque", data=data))
            self._watcher = threading.Thread(target=self._watch, name="executor-k8s", daemon=True)
            self._watcher.start()
            if self.k8s.shape == "pods":
                selector = {k.EXECUTOR: self.name}  # a headless Service: pod POD.NAME
                spec = {"clusterIP": "None", "selector": selector, "publishNotReadyAddresses": True}
                self.kube.create(k.obj("Service", self._meta(self.name), spec=spec))
            else:
                at = args.index("--node-rank") + 1
                worker = (*args[:at], "$(LWS_WORKER_INDEX)", *args[at + 1 :])
                specs = [k.pod_spec(self.k8s, a, self.name, gpus, "Always") for a in (args, worker)]
                self.kube.create(k.lws(self._meta(self.name), self.config.num_nodes, *specs))
        if self.k8s.shape == "lws":
            self._names[rank] = f"{self.name}-0" + (f"-{rank}" if rank else "")
            return
        name = self._names.setdefault(rank, f"{self.name}-{rank}")
        pod = self.kube.pod(name)
        if pod is not None and said(pod, self._asked)[1]:  # ended for good: made again
            self._delete_pods([name], 0)
            pod = None
        if pod is None:
            spec = k.pod_spec(self.k8s, args, self.name, gpus, "OnFailure")
            spec.update(hostname=name, subdomain=self.name)  # named POD.SERVICE
            self.kube.create(k.obj("Pod", self._meta(name, {k.NODE_RANK: str(rank)}), spec=spec))

    def check(self, launch: AgentLaunch) -> None:
        name = self._names[launch.node_rank]
        pod = self.kube.pod(name)
        what, fatal = said(pod, self._asked) if pod else (f"pod {name} does not exist (yet)", False)
        if fatal or (_now() - self._asked).total_seconds() > self.k8s.pending_timeout_s:
            bound = "" if fatal else f" within pending_timeout_s={self.k8s.pending_timeout_s:g} s"
            raise ExecutorError(
                f"the pod of node {launch.node_rank} ({name}) did not start{bound}: Kubernetes "
                f"says {what or 'nothing'}{self.kube.warnings(name)}"
            )

    def stop(self, launch: AgentLaunch) -> None:
        """Nothing: the agent exits or rejoins; :meth:`close` deletes every pod."""

    def close(self) -> None:
        self._stop.set()
        try:
            if self._watcher is not None:
                self._watcher.join(5.0)
                # Agents told to stop get shutdown_grace_s to exit before their pods go (one
                # that exits 1, a worker having died, may be running again: not awaited).
                deadline = time.monotonic() + self.options.shutdown_grace_s + 2.0
                first = self._running()
                while time.monotonic() < deadline and self._running() & first:
                    time.sleep(0.1)
                self._delete_all(self.name, list(self._names.values()))
        finally:
            self.kube.close()

    def hint(self, launches: tuple[AgentLaunch, ...]) -> str:
        return (
            f"their pods are in namespace {self.kube.namespace}, labelled {k.EXECUTOR}="
            f"{self.name} (kubectl get pods -l ...; kubectl logs): each agent must reach "
            f"{launches[0].address} (set ExecutorConfig.distributed_host to this machine's "
            "address as the pods reach it)"
        )

    def _meta(self, name: str, extra: dict[str, str] | None = None) -> dict[str, Any]:
        labels = {**self.labels, **(extra or {})}
        meta = {"name": name, "namespace": self.kube.namespace, "labels": labels}
        return {**meta, "ownerReferences": self.owners} if self.owners else meta

    def _running(self) -> set[tuple[str, int]]:
        """The pods whose agent runs, with its restart count."""
        pods = self.kube.pods({k.EXECUTOR: self.name})
        return {(p.metadata.name, c.restart_count) for p in pods
                for c in p.status.container_statuses or [] if c.state.running}  # fmt: skip

    def _delete_pods(self, names: list[str], grace: int | None) -> None:
        """Delete pods and wait until they are gone (force-deleted after ``_GONE_S``)."""
        for name in names:
            self.kube.delete("pod", name, grace_period_seconds=grace)
        deadline = time.monotonic() + _GONE_S
        while any(self.kube.pod(name) is not None for name in names):
            if time.monotonic() > deadline:
                if grace == 0:
                    raise ExecutorError(f"pods {names} were not deleted within {_GONE_S:g} s")
                return self._delete_pods(names, 0)
            time.sleep(0.1)

    def _delete_all(self, name: str, pods: list[str]) -> None:
        """Delete an executor's objects, its pods first (waiting for them, bounded)."""
        if self.k8s.shape == "lws":
            self.kube.delete("LeaderWorkerSet", name, propagation_policy="Background")
        self._delete_pods(pods, None)
        for kind in ("service", "secret"):
            self.kube.delete(kind, name)

    def _sweep(self) -> None:
        """Delete what killed drivers left: executors whose every pod has ended (their
        agents exit once their driver is silent) and nothing else."""
        by_executor: dict[str, list[Any]] = {}
        for pod in self.kube.pods(k.MANAGED):
            by_executor.setdefault((pod.metadata.labels or {}).get(k.EXECUTOR, ""), []).append(pod)
        for name, group in by_executor.items():
            if name and all(p.status.phase in ("Succeeded", "Failed") for p in group):
                logger.info("k8s: deleting %s, left by a driver that is gone", name)
                self._delete_all(name, [p.metadata.name for p in group])

    def _watch(self) -> None:
        """Every ``_WATCH_S``: a pod whose container ended, or that was restarted, failed or
        deleted since the last look is reported (``agent_lost``) with Kubernetes' reason. If
        the channel saw the agent go first, its error has the reason from :meth:`explain`."""
        seen: dict[str, Any] = {}
        while not self._stop.wait(_WATCH_S):
            try:
                pods = self.kube.pods({k.EXECUTOR: self.name})
            except ExecutorError as exc:
                logger.warning("k8s: %s", exc)
                continue
            ranks = {name: rank for rank, name in dict(self._names).items()}  # a copy
            for pod in pods:
                name, meta, status = pod.metadata.name, pod.metadata, pod.status
                runs = [
                    (c.restart_count, not c.state.running) for c in status.container_statuses or []
                ]
                state = (meta.uid, status.phase, meta.deletion_timestamp, runs)
                before, seen[name] = seen.get(name), state
                if before is None or before == state or name not in ranks:
                    continue
                what, fatal = said(pod, self._asked)  # an end since this incarnation's start
                if fatal:
                    logger.warning("k8s: node %d: Kubernetes: %s", ranks[name], what)
                    self.agent_lost(ranks[name], f"Kubernetes: {what}{self.kube.warnings(name)}")


def _driver_pod(namespace: str) -> list[dict[str, Any]]:
    """An owner reference to the driver's pod (``POD_NAME``, ``POD_UID`` and
    ``POD_NAMESPACE`` from the downward API) when it runs in ``namespace``: the garbage
    collector then deletes every object when that pod goes."""
    name, uid = os.environ.get("POD_NAME"), os.environ.get("POD_UID")
    if not name or not uid or os.environ.get("POD_NAMESPACE") != namespace:
        return []
    return [{"apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid}]


class KubernetesExecutor(MultiprocExecutor):
    """``mp`` with its node agents placed by :class:`KubernetesPlacement` (backend
    ``"k8s"``). ``executor.config.backend_options`` holds ``mp``'s keys and the
    Kubernetes ones (see :class:`~executor_plugin_kubernetes.KubernetesOptions`)."""

    options_cls = KubernetesOptions
    placement_cls = KubernetesPlacement
