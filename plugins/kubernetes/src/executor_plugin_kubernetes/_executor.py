"""The ``k8s`` backend: ``mp``'s executor whose node agents run in pods.

:class:`KubernetesPlacement` (a :class:`~executor_plugin_multiproc.launcher.Placement`)
creates, at the first start, the channel's ``Secret`` and either a headless ``Service`` and
one pod per node (``shape="pods"``) or a ``LeaderWorkerSet`` of ``num_nodes`` pods
(``shape="lws"``); each pod runs that node's ``executor node``. A pod is restarted alone
(its own restart policy, never the group's); its agent then joins the executor again
(``agents_rejoin``), so a recovery keeps every other pod and its agent. A pod that cannot
start fails the start with Kubernetes' reason; one that dies later is reported through
``Placement.agent_lost`` with it. Everything else (the port, admission, heartbeats, every
rule of a call) is ``mp``'s.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any, ClassVar, Self

from executor_channel import Secret
from executor_core import ConfigError, ExecutorConfig, ExecutorError
from executor_plugin_multiproc import MultiprocExecutor, MultiprocOptions
from executor_plugin_multiproc.launcher import AgentLaunch, Placement

from . import _manifests as m
from ._kube import LWS, ApiError, Kube
from ._options import KubernetesOptions

__all__ = ["KubernetesExecutor", "KubernetesPlacement"]

logger = logging.getLogger("executor_plugin_kubernetes")

#: A container waiting for one of these will not start by itself.
_STUCK = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
          "CreateContainerError", "CrashLoopBackOff", "RunContainerError"}  # fmt: skip
#: Seconds between two looks at the pods after the start (each one request).
_WATCH_S = 0.3
#: Seconds a deleted pod may take to go before it is force-deleted.
_GONE_S = 20.0


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def said(pod: Any, since: datetime.datetime) -> tuple[str, bool]:
    """What Kubernetes says of ``pod`` (the kubelet's and the scheduler's reasons), and
    whether it cannot run any more (a termination after ``since`` counts, an older one
    was already seen and recovered)."""
    status, name = pod.status, pod.metadata.name
    if pod.metadata.deletion_timestamp is not None:
        return f"pod {name} is being deleted", True
    if status.phase in ("Failed", "Succeeded"):
        why = f" ({status.reason}: {status.message})" if status.reason else ""
        return f"pod {name} {status.phase}{why}", True
    for c in status.container_statuses or []:
        done = c.state.terminated or (c.last_state.terminated if c.restart_count else None)
        ended = f"exit code {done.exit_code}, reason {done.reason}" if done else ""
        if c.state.waiting is not None and c.state.waiting.reason in _STUCK:
            last = f" (last run: {ended})" if ended else ""
            recent = done is None or done.finished_at is None or done.finished_at > since
            fatal = c.state.waiting.reason != "CrashLoopBackOff" or recent
            return f"{c.state.waiting.reason}: {c.state.waiting.message}{last}", fatal
        if done is not None and (done.finished_at is None or done.finished_at > since):
            return (
                f"container {c.name} ended: {ended}{f' ({done.message})' if done.message else ''}",
                True,
            )
    for cond in status.conditions or []:
        if cond.type == "DisruptionTarget" and cond.status == "True":
            return f"{cond.reason}: {cond.message}", True
        if cond.type == "PodScheduled" and cond.status == "False":
            return f"{cond.reason}: {cond.message}", False
    return "", False


class KubernetesPlacement(Placement):
    """Each node's agent in a pod of its own (see the module). Made as :class:`_NodeZero`
    (``driver_runs_ranks = True``) with ``backend_options['driver_runs_ranks']``."""

    driver_runs_ranks = False
    agents_rejoin: ClassVar[bool] = True

    def __new__(cls, config: ExecutorConfig, options: MultiprocOptions) -> Self:
        assert isinstance(options, KubernetesOptions)  # KubernetesExecutor's options_cls
        if cls is KubernetesPlacement and options.driver_runs_ranks:
            if options.shape == "lws":
                raise ConfigError(
                    "backend_options",
                    {"driver_runs_ranks": True, "shape": "lws"},
                    "a LeaderWorkerSet group is every node: the driver runs outside it",
                )
            cls = _NodeZero  # type: ignore[assignment]
        return super().__new__(cls)

    def __init__(self, config: ExecutorConfig, options: MultiprocOptions) -> None:
        super().__init__(config, options)
        assert isinstance(options, KubernetesOptions)
        self.k8s = options
        if options.image is None:
            raise ConfigError(
                "backend_options", {"image": None}, "the pods need an image: set 'image'"
            )
        self.kube = Kube(options)
        #: This executor's name: of its Secret, Service, LWS, and in every object's label.
        self.name = f"executor-{secrets.token_hex(4)}"
        self.labels = {**options.labels, **m.MANAGED, m.EXECUTOR: self.name}
        self.owners = _driver_pod(self.kube.namespace)
        self._port = 0
        self._secret: Secret | None = None
        self._asked = _now()  # when the current incarnation's pods were asked for
        self._created = False
        self._names: dict[int, str] = {}
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        try:
            self.kube.preflight(options.shape == "lws")
            self._sweep()
        except BaseException:
            self.kube.close()
            raise

    # --- the contract ------------------------------------------------------------------

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
        self._asked = _now()
        ns, rank = self.kube.namespace, launch.node_rank
        if not self._created:
            self._created = True
            body = m.secret(self._meta(self.name), launch.secret.hex())
            self.kube.call(
                "creating the channel's Secret", self.kube.core.create_namespaced_secret, ns, body
            )
            if self.k8s.shape == "pods":
                svc = m.service(self._meta(self.name), {m.EXECUTOR: self.name})
                self.kube.call(
                    "creating the Service", self.kube.core.create_namespaced_service, ns, svc
                )
            else:
                self._create_lws(launch)
            self._watcher = threading.Thread(
                target=self._watch, name="executor-k8s-watch", daemon=True
            )
            self._watcher.start()
        if self.k8s.shape == "lws":
            self._names[rank] = f"{self.name}-0" + (f"-{rank}" if rank else "")
            return
        name = self._names.setdefault(rank, f"{self.name}-{rank}")
        pod = self._read(name)
        if pod is not None and said(pod, self._asked)[1]:  # ended: made again
            self._delete_pods([name], 0)
            pod = None
        if pod is None:
            spec = m.pod_spec(self.k8s, _args(launch), self.name, self._gpus(), "OnFailure")
            body = m.pod(self._meta(name, {m.NODE_RANK: str(rank)}), spec, self.name)
            self.kube.call(f"creating pod {name}", self.kube.core.create_namespaced_pod, ns, body)

    def check(self, launch: AgentLaunch) -> None:
        name = self._names[launch.node_rank]
        pod = self._read(name)
        if pod is None:
            what, fatal = f"pod {name} does not exist (yet)", False
        else:
            what, fatal = said(pod, self._asked)
        waited = (_now() - self._asked).total_seconds()
        if fatal or waited > self.k8s.pending_timeout_s:
            bound = "" if fatal else f" within pending_timeout_s={self.k8s.pending_timeout_s:g} s"
            raise ExecutorError(
                f"the pod of node {launch.node_rank} ({name}) did not start{bound}: Kubernetes "
                f"says {what or 'nothing'}{self._events(name)}"
            )

    def stop(self, launch: AgentLaunch) -> None:
        """Nothing now: a pod's agent exits when told to stop, or rejoins the next
        incarnation; :meth:`close` deletes every pod."""

    def close(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(5.0)
        try:
            if self._created:
                self._await_exits(self.options.shutdown_grace_s + 2.0)
                self._delete_all(self.name, list(self._names.values()))
        finally:
            self.kube.close()

    def hint(self, launches: tuple[AgentLaunch, ...]) -> str:
        return (
            f"their pods are in namespace {self.kube.namespace}, labelled {m.EXECUTOR}="
            f"{self.name} (kubectl get pods -l ...; kubectl logs): each agent must reach "
            f"{launches[0].address} (set ExecutorConfig.distributed_host to this machine's "
            "address as the pods reach it)"
        )

    # --- the objects ---------------------------------------------------------------------

    def _meta(self, name: str, extra: dict[str, str] | None = None) -> dict[str, Any]:
        return m.meta(name, self.kube.namespace, {**self.labels, **(extra or {})}, self.owners)

    def _gpus(self) -> int:
        config = self.config
        return config.world_size // config.num_nodes if config.device == "cuda" else 0

    def _create_lws(self, launch: AgentLaunch) -> None:
        args = _args(launch)
        at = args.index("--node-rank") + 1
        worker = (*args[:at], "$(LWS_WORKER_INDEX)", *args[at + 1 :])
        specs = [m.pod_spec(self.k8s, a, self.name, self._gpus(), "Always") for a in (args, worker)]
        body = m.lws(self._meta(self.name), self.config.num_nodes, *specs)
        group, version, plural = LWS
        self.kube.call(
            "creating the LeaderWorkerSet (is the LWS controller installed?)",
            self.kube.custom.create_namespaced_custom_object,
            group, version, self.kube.namespace, plural, body,
        )  # fmt: skip

    def _read(self, name: str) -> Any:
        try:
            return self.kube.call(
                f"reading pod {name}", self.kube.core.read_namespaced_pod, name, self.kube.namespace
            )
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def _events(self, name: str) -> str:
        """The pod's last warnings (the scheduler's, the kubelet's), for an error."""
        with contextlib.suppress(ExecutorError):
            events = self.kube.call(
                "reading events", self.kube.core.list_namespaced_event, self.kube.namespace,
                field_selector=f"involvedObject.name={name}",
            ).items  # fmt: skip
            warned = [f"{e.reason}: {e.message}" for e in events if e.type == "Warning"][-3:]
            if warned:
                return "; events: " + " | ".join(warned)
        return ""

    def _delete_pods(self, names: list[str], grace: int | None) -> None:
        ns, core = self.kube.namespace, self.kube.core
        for name in names:
            with contextlib.suppress(ApiError):
                self.kube.call(
                    f"deleting pod {name}",
                    core.delete_namespaced_pod,
                    name,
                    ns,
                    grace_period_seconds=grace,
                )
        deadline = time.monotonic() + _GONE_S
        while any(self._read(name) is not None for name in names):
            if time.monotonic() > deadline:
                if grace == 0:
                    raise ExecutorError(f"pods {names} were not deleted within {_GONE_S:g} s")
                self._delete_pods(names, 0)
                return
            time.sleep(0.1)

    def _await_exits(self, bound: float) -> None:
        """Give agents told to stop ``bound`` seconds to exit before their pods go."""
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            pods = [self._read(name) for name in self._names.values()]
            if not any(p is not None and p.status.phase == "Running" for p in pods):
                return
            time.sleep(0.1)

    def _delete_all(self, name: str, pods: list[str]) -> None:
        """Delete an executor's objects; wait, within a bound, until its pods are gone."""
        ns, core = self.kube.namespace, self.kube.core
        with contextlib.suppress(ApiError):
            group, version, plural = LWS
            if self.k8s.shape == "lws":
                self.kube.call(
                    "deleting the LeaderWorkerSet", self.kube.custom.delete_namespaced_custom_object,
                    group, version, ns, plural, name, propagation_policy="Background",
                )  # fmt: skip
        self._delete_pods(pods, None)
        for kind, delete in (
            ("Service", core.delete_namespaced_service),
            ("Secret", core.delete_namespaced_secret),
        ):
            if kind == "Service" and self.k8s.shape == "lws":
                continue
            with contextlib.suppress(ApiError):
                self.kube.call(f"deleting {kind} {name}", delete, name, ns)

    def _sweep(self) -> None:
        """Delete what killed drivers left: executors whose every pod has ended (their
        agents exit once their driver is silent) and nothing else."""
        pods = self.kube.call(
            "listing pods", self.kube.core.list_namespaced_pod, self.kube.namespace,
            label_selector=",".join(f"{k}={v}" for k, v in m.MANAGED.items()),
        ).items  # fmt: skip
        by_executor: dict[str, list[Any]] = {}
        for pod in pods:
            by_executor.setdefault((pod.metadata.labels or {}).get(m.EXECUTOR, ""), []).append(pod)
        for name, group in by_executor.items():
            if name and all(p.status.phase in ("Succeeded", "Failed") for p in group):
                logger.info("k8s: deleting %s, left by a driver that is gone", name)
                self._delete_all(name, [p.metadata.name for p in group])

    # --- after the start -----------------------------------------------------------------

    def _watch(self) -> None:
        """Look at the pods every ``_WATCH_S``: one that ended or was restarted since the
        last look is reported (``agent_lost``) with Kubernetes' reason."""
        seen: dict[str, Any] = {}
        while not self._stop.wait(_WATCH_S):
            try:
                pods = self.kube.call(
                    "listing pods", self.kube.core.list_namespaced_pod, self.kube.namespace,
                    label_selector=f"{m.EXECUTOR}={self.name}",
                ).items  # fmt: skip
            except ExecutorError as exc:
                logger.warning("k8s: %s", exc)
                continue
            ranks = {name: rank for rank, name in self._names.items()}
            for pod in pods:
                name = pod.metadata.name
                restarts = sum(c.restart_count for c in pod.status.container_statuses or [])
                state = (
                    pod.metadata.uid,
                    restarts,
                    pod.status.phase,
                    pod.metadata.deletion_timestamp,
                )
                before, seen[name] = seen.get(name), state
                if before is None or before == state or name not in ranks:
                    continue
                what, fatal = said(pod, _now() - datetime.timedelta(seconds=5))
                if fatal:  # the channel may have seen it first: then this is logged only
                    logger.warning("k8s: node %d: Kubernetes: %s", ranks[name], what)
                    self.agent_lost(ranks[name], f"Kubernetes: {what}{self._events(name)}")


class _NodeZero(KubernetesPlacement):
    """This process runs node 0's ranks; pods are nodes 1 .. ``num_nodes - 1``."""

    driver_runs_ranks = True

    def node_id(self) -> str:
        return os.environ.get("POD_NAME") or super().node_id()


def _args(launch: AgentLaunch) -> tuple[str, ...]:
    """The agent's arguments past ``python -m executor_core``."""
    assert launch.argv[1:3] == ("-m", "executor_core"), launch.argv
    return launch.argv[3:]


def _driver_pod(namespace: str) -> list[dict[str, Any]]:
    """An owner reference to the driver's pod (``POD_NAME``, ``POD_UID`` and
    ``POD_NAMESPACE`` from the downward API) when it runs in ``namespace``: the garbage
    collector then deletes every object when that pod goes."""
    name, uid = os.environ.get("POD_NAME"), os.environ.get("POD_UID")
    if not name or not uid or os.environ.get("POD_NAMESPACE") != namespace:
        return []
    return [
        {"apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid, "blockOwnerDeletion": False}
    ]


class KubernetesExecutor(MultiprocExecutor):
    """``mp`` with its node agents placed by :class:`KubernetesPlacement` (backend
    ``"k8s"``). ``executor.config.backend_options`` holds ``mp``'s keys and the
    Kubernetes ones (see :class:`~executor_plugin_kubernetes.KubernetesOptions`)."""

    options_cls = KubernetesOptions
    placement_cls = KubernetesPlacement
