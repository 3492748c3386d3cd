"""The k8s backend against the test cluster (an API server over real HTTP and a kubelet that
runs each pod's command here): where agents run and how the secret reaches them, what each
failure says (Kubernetes' own reason), what a killed pod or driver leaves, and the bad input
refused before any object is created. Every test leaves no object or process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from k8s_cluster import NODE_LABELS, Cluster

from executor_core import (
    ConfigError,
    ExecutorConfig,
    ExecutorError,
    ExecutorState,
    RecoveryPolicy,
    WorkerDiedError,
    create_executor,
)
from executor_core.testing import conformance_config
from executor_plugin_kubernetes import KubernetesOptions
from executor_plugin_kubernetes._kube import pod_spec

pytestmark = pytest.mark.slow
DATA = Path(__file__).parent / "data"


def _config(
    world_size: int = 2,
    recovery: RecoveryPolicy | None = None,
    worker_kwargs: dict[str, Any] | None = None,
    **options: Any,
) -> ExecutorConfig:
    backend_options = {"image": "executor-test:1", "startup_timeout": 30.0, **options}
    return conformance_config(
        "k8s",
        world_size=world_size,
        num_nodes=2,
        recovery=recovery,
        backend_options=backend_options,
        worker_kwargs=worker_kwargs or {},
    )


def _wait(what: str, done: Callable[[], bool], bound: float = 15.0) -> None:
    deadline = time.monotonic() + bound
    while not done():
        assert time.monotonic() < deadline, f"not within {bound} s: {what}"
        time.sleep(0.05)


def test_agents_run_in_pods_with_the_secret_as_a_0600_file(k8s: Cluster) -> None:
    """The driver outside: every node is a pod, named by it; the secret is a mounted file
    of mode 0600, never in a manifest, an environment or a command line."""
    with create_executor(_config()) as ex:
        nodes = [c.node_id for c in ex.collective_rpc("get_context")]
        pods = k8s.pods()
        assert sorted(nodes) == sorted(pods)
        secret = next(o for (kind, _, _), o in k8s.objects.items() if kind == "secrets")
        hex_key = __import__("base64").b64decode(secret["data"]["secret"]).decode()
        for name, pod in pods.items():
            spec = pod["spec"]
            assert spec["restartPolicy"] == "OnFailure"
            assert spec["volumes"][0]["secret"]["defaultMode"] == 0o600
            assert hex_key not in json.dumps(pod)
            path = k8s.root / pod["metadata"]["uid"] / "var/run/executor-sdk/secret"
            assert path.stat().st_mode & 0o777 == 0o600
            proc = Path(f"/proc/{k8s.pid(name)}")
            assert hex_key.encode() not in (proc / "cmdline").read_bytes()
            assert hex_key.encode() not in (proc / "environ").read_bytes()


@pytest.mark.parametrize("killed", [1, 0])
def test_a_killed_pod_is_restarted_alone_and_only_its_ranks_replaced(
    k8s: Cluster, killed: int
) -> None:
    """The kubelet restarts the OOM-killed pod (restartPolicy OnFailure); the other pod, its
    agent and its worker keep their processes; Kubernetes' reason reaches the caller; the
    executor replaces only the killed pod's rank, on the agent that joins in its place. Node
    0's pod hosts the torch rendezvous (the driver runs no ranks): a new one is asked of its
    agent, or, if that pod is the one killed, of the new agent. Every worker joins a gloo
    group there as it starts or rejoins: the recovery completes only if they meet."""
    recovery = RecoveryPolicy(max_restarts=3, backoff_s=0.0)
    config = _config(recovery=recovery, worker_kwargs={"gloo": True}, node_timeout_s=5.0)
    with create_executor(config) as ex:
        workers = ex.collective_rpc("get_pid")
        pods = sorted(k8s.pods())
        alive = 1 - killed
        survivor = k8s.pid(pods[alive])
        call = ex.collective_rpc("slow", args=(3.0,), non_block=True)  # the survivor's ends
        k8s.kill(pods[killed], oom=True)
        with pytest.raises(WorkerDiedError, match=f"rank {killed} on node {pods[killed]}") as info:
            call.result(timeout=30)
        # Whoever saw the death first (the pod watcher, or the channel: the agent's link
        # dropped), the error says why, as Kubernetes does.
        assert "reason OOMKilled" in str(info.value)
        _wait("the recovery", lambda: ex.last_recovery is not None, 30.0)
        assert ex.collective_rpc("get_rank", timeout=30) == [0, 1]
        assert ex.state is ExecutorState.RUNNING
        record = ex.last_recovery
        assert record is not None
        assert (record.kind, record.ranks) == ("replace", (killed,)), record
        after = k8s.pods()
        assert sorted(after) == pods
        assert k8s.pid(pods[alive]) == survivor
        assert after[pods[alive]]["status"]["containerStatuses"][0]["restartCount"] == 0
        assert after[pods[killed]]["status"]["containerStatuses"][0]["restartCount"] == 1
        pids = ex.collective_rpc("get_pid")
        assert pids[alive] == workers[alive]  # the survivor kept its process
        assert pids[killed] != workers[killed]


def test_an_evicted_pod_fails_calls_and_is_made_again(k8s: Cluster) -> None:
    """The driver runs node 0's rank: the evicted pod (gone for good) is made again, its
    rank replaced there, and the driver's worker keeps its process."""
    recovery = RecoveryPolicy(max_restarts=3, backoff_s=0.0)
    with create_executor(
        _config(recovery=recovery, node_timeout_s=5.0, driver_runs_ranks=True)
    ) as ex:
        workers = ex.collective_rpc("get_pid")
        (pod,) = k8s.pods()
        uid = k8s.pods()[pod]["metadata"]["uid"]
        call = ex.collective_rpc("slow", args=(3.0,), non_block=True)
        k8s.evict(pod)
        with pytest.raises(WorkerDiedError, match=f"rank 1 on node {pod}") as info:
            call.result(timeout=30)
        assert "Failed (Evicted: The node was low on resource" in str(info.value)
        _wait("the recovery", lambda: ex.last_recovery is not None, 30.0)
        assert ex.collective_rpc("get_rank", timeout=30) == [0, 1]
        assert k8s.pods()[pod]["metadata"]["uid"] != uid
        record = ex.last_recovery
        assert record is not None
        assert (record.kind, record.ranks) == ("replace", (1,)), record
        assert ex.collective_rpc("get_pid")[0] == workers[0]


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (
            {"node_selector": {"gpu": "h100"}, "pending_timeout_s": 1.0},
            "Unschedulable: 0/2 nodes are available",
        ),
        ({"image": "unpullable/model:1"}, "ImagePull"),
    ],
)
def test_a_pod_that_cannot_start_fails_the_start_with_the_reason(
    k8s: Cluster, options: dict[str, Any], said: str
) -> None:
    started = time.monotonic()
    with pytest.raises(ExecutorError, match="did not start") as info:
        create_executor(_config(**options))
    assert said in str(info.value)
    assert "events: " in str(info.value)  # FailedScheduling / Failed to pull image
    assert time.monotonic() - started < 10


DRIVER = textwrap.dedent(
    """
    import json, sys
    from executor_core import create_executor
    from executor_core.testing import conformance_config

    if __name__ == "__main__":
        executor = create_executor(conformance_config(
            "k8s", world_size=2, num_nodes=2,
            backend_options={"image": "executor-test:1", "node_timeout_s": 2.0},
        ))
        print(json.dumps(executor.collective_rpc("get_pid")), flush=True)
        executor.collective_rpc("slow", args=(60.0,))
    """
)


def test_after_a_killed_driver_nothing_is_left(k8s: Cluster, tmp_path: Path) -> None:
    """The agents exit once their driver is silent (status 3, made 0: OnFailure leaves the
    pod Succeeded); the next executor's start deletes what the dead one left."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout is not None
        assert driver.stdout.readline(), "the driver did not start"
        agents = [k8s.pid(name) for name in k8s.pods()]
        driver.send_signal(signal.SIGKILL)
        driver.wait(10)
        _wait(
            "the pods to end",
            lambda: {p["status"]["phase"] for p in k8s.pods().values()} == {"Succeeded"},
        )
        assert not k8s.procs
        for pid in agents:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        assert k8s.kinds()  # left until the next start
        with create_executor(_config()) as ex:
            ex.collective_rpc("get_rank")
            assert len(k8s.pods()) == 2
    finally:
        if driver.poll() is None:
            driver.kill()
        driver.communicate(timeout=10)


def test_bad_input_is_refused_before_anything_is_created(k8s: Cluster, tmp_path: Path) -> None:
    sent = len(k8s.sent)
    k8s.denied.add(("create", "pods"))
    try:
        with pytest.raises(ExecutorError, match="may not create pods in namespace 'default'"):
            create_executor(_config())
    finally:
        k8s.denied.clear()
    with pytest.raises(ConfigError, match="no such namespace"):
        create_executor(_config(namespace="nowhere"))
    with pytest.raises(ConfigError, match="need an image"):
        create_executor(_config(image=None))
    for bad, says in [
        ({"image": 3}, "image reference"),
        ({"tolerations": "gpu"}, "list of tolerations"),
        ({"resources": {"limits": {"memory": "lots"}}}, "quantity"),
        ({"node_selector": {"pool": 1}}, "label value"),
        ({"shape": "statefulset"}, "shape"),
        ({"shape": "lws", "driver_runs_ranks": True}, "runs outside"),
    ]:
        with pytest.raises(ConfigError, match=says):
            create_executor(_config(**bad))
    down = Cluster.kubeconfig(k8s, tmp_path / "down", url="http://127.0.0.1:9")
    with pytest.raises(ExecutorError, match="did not answer"):
        create_executor(_config(kubeconfig=str(down)))
    with pytest.raises(ExecutorError, match="no Kubernetes API server"):
        create_executor(_config(kubeconfig=str(tmp_path / "absent")))
    assert len(k8s.sent) == sent  # nothing was created


def test_a_leaderworkerset_group_and_every_manifest_validates(k8s: Cluster) -> None:
    """shape="lws": one group of num_nodes pods (leader node 0), each restarted alone (a
    killed worker pod costs its rank alone: the leader's worker keeps its process); every
    object the backend sent validates against Kubernetes 1.37's schemas, the LWS against
    its CRD's (and its pod templates against PodTemplateSpec)."""
    options = {
        "labels": {"team": "ml"},
        "node_selector": dict(NODE_LABELS),
        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "resources": {"limits": {"memory": "1Gi", "cpu": 2}},
        "service_account": "inference",
    }
    first = len(k8s.sent)
    with create_executor(_config(**options)) as ex:
        ex.collective_rpc("get_rank")
    recovery = RecoveryPolicy(max_restarts=1, backoff_s=0.0)
    with create_executor(
        _config(shape="lws", recovery=recovery, node_timeout_s=5.0, **options)
    ) as ex:
        nodes = [c.node_id for c in ex.collective_rpc("get_context")]
        assert nodes[0].endswith("-0"), nodes
        assert nodes[1].endswith("-0-1"), nodes
        workers = ex.collective_rpc("get_pid")
        k8s.kill(nodes[1])
        _wait("the recovery", lambda: ex.last_recovery is not None, 30.0)
        record = ex.last_recovery
        assert record is not None
        assert (record.kind, record.ranks) == ("replace", (1,)), record
        pids = ex.collective_rpc("get_pid", timeout=30)
        assert pids[0] == workers[0]
        assert pids[1] != workers[1]
    sent = k8s.sent[first:]
    kinds = sorted(body["kind"] for body in sent)
    assert kinds == ["LeaderWorkerSet", "Pod", "Pod", "Secret", "Secret", "Service"], kinds
    schema = json.loads((DATA / "lws-v1-schema.json").read_text())
    for body in sent:
        if body["kind"] != "LeaderWorkerSet":
            kubernetes_validate.validate(body, "1.37.0", strict=True)
            continue
        jsonschema.validate(body, schema)
        template = body["spec"]["leaderWorkerTemplate"]
        assert template["restartPolicy"] == "None"
        assert template["size"] == 2
        for part in ("leaderTemplate", "workerTemplate"):
            wrapped = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": "t"},
                "template": template[part],
            }
            kubernetes_validate.validate(wrapped, "1.37.0", strict=True)


def test_gpus_per_pod_and_the_backend_listed() -> None:
    options = KubernetesOptions.from_backend_options({"image": "img:1"})
    limits = pod_spec(options, ("node",), "s", 4, "OnFailure")["containers"][0]["resources"]
    assert limits == {"requests": {"nvidia.com/gpu": "4"}, "limits": {"nvidia.com/gpu": "4"}}
    out = subprocess.run(
        [sys.executable, "-m", "executor_core", "backends"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    line = next(line for line in out.splitlines() if line.startswith("k8s "))
    assert "kubernetes" in line
    assert "multi-node" in line
    assert "recovery: replace" in line
