"""A driver that is SIGKILLed: its actors exit within 2 s, on every node (``_lifeline``).

Ray ends a dead driver's job once it notices, through the driver's connection to its raylet
(tens of ms when nothing else holds it). A child the driver forked holds a copy of that
connection, and then Ray does not notice for as long as the child lives: the end-to-end test
below gives its driver such a child, so that only the lifelines can end the actors in time.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import psutil  # type: ignore[import-untyped]  # psutil ships no type information
import pytest
import ray
from ray.cluster_utils import Cluster

from executor_core.testing._guard import pids_alive
from executor_plugin_ray._lifeline import EXIT_CODE, DriverLifelines, hold

#: Seconds from the driver's SIGKILL by which every one of its actors must have exited.
WITHIN_S = 2.0


# --- the lifeline on its own (no Ray) -------------------------------------------------------

LIFELINE_DRIVER = textwrap.dedent(
    """
    import json, multiprocessing, sys, time
    from executor_plugin_ray._lifeline import DriverLifelines

    lifelines = DriverLifelines()
    address = lifelines.listen(None if sys.argv[1] == "unix" else "127.0.0.1")
    print(json.dumps([address, lifelines.key.hex()]), flush=True)
    while lifelines.held < 1:
        time.sleep(0.01)
    lifelines.stop_listening()
    # A forked child must not keep the lifeline open once this process is gone.
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    child.start()
    print(child.pid, flush=True)
    time.sleep(60)
    """
)

LIFELINE_ACTOR = textwrap.dedent(
    """
    import json, sys, time
    from executor_plugin_ray._lifeline import hold

    address = json.loads(sys.argv[1])
    hold(address if isinstance(address, str) else tuple(address), bytes.fromhex(sys.argv[2]))
    print("held", flush=True)
    time.sleep(60)
    """
)


Started = subprocess.Popen[str] | psutil.Process


@pytest.fixture
def started() -> Iterator[list[Started]]:
    """The processes a test started, killed at its end whatever happened (a psutil.Process,
    taken while the process runs, is never mistaken for a later one with its pid)."""
    processes: list[Started] = []
    yield processes
    for process in processes:
        if isinstance(process, psutil.Process):
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
            continue
        if process.poll() is None:
            process.kill()
        process.wait(10)
        if process.stdout is not None:
            process.stdout.close()


def _python(started: list[Started], script: str, *args: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True
    )
    started.append(process)
    return process


def _readline(process: subprocess.Popen[str]) -> str:
    assert process.stdout is not None
    return process.stdout.readline()


@pytest.mark.parametrize("kind", ["unix", "tcp"])
def test_the_actor_exits_when_the_driver_process_dies(kind: str, started: list[Started]) -> None:
    driver = _python(started, LIFELINE_DRIVER, kind)
    address, key = json.loads(_readline(driver))
    actor = _python(started, LIFELINE_ACTOR, json.dumps(address), key)
    assert _readline(actor) == "held\n"
    child = psutil.Process(int(_readline(driver)))
    started.append(child)
    killed = time.monotonic()
    driver.kill()
    assert actor.wait(WITHIN_S) == EXIT_CODE
    print(f"{kind}: the actor exited {time.monotonic() - killed:.3f} s after the kill")
    assert child.is_running(), "the driver's forked child outlived it"


def test_a_goodbye_is_no_death(started: list[Started]) -> None:
    lifelines = DriverLifelines()
    try:
        address = lifelines.listen(None)
        actor = _python(started, LIFELINE_ACTOR, json.dumps(address), lifelines.key.hex())
        assert _readline(actor) == "held\n"
        assert lifelines.held == 1
        lifelines.close()  # the executor's shutdown
        time.sleep(0.5)
        assert actor.poll() is None
    finally:
        lifelines.close()


def test_a_wrong_key_or_a_stalled_peer_gets_no_lifeline(started: list[Started]) -> None:
    lifelines = DriverLifelines()
    try:
        address = lifelines.listen("127.0.0.1")
        assert isinstance(address, tuple)
        with socket.create_connection(address) as stalled:  # connects and says nothing
            with pytest.raises(ConnectionError):
                hold(address, b"not the key" * 3)
            assert lifelines.held == 0
            # The stalled peer holds no one up: the actor with the key gets its lifeline.
            actor = _python(started, LIFELINE_ACTOR, json.dumps(address), lifelines.key.hex())
            assert _readline(actor) == "held\n"
            assert lifelines.held == 1
            lifelines.stop_listening()
            stalled.settimeout(5)
            received = b""
            while chunk := stalled.recv(64):
                received += chunk
            assert len(received) == 32  # the driver's nonce; then it dropped the peer
    finally:
        lifelines.close()


def test_prune_closes_only_the_lifelines_of_gone_actors(started: list[Started]) -> None:
    """A rank replacement's new actor holds a new lifeline; the dead one's is closed here,
    not kept open until shutdown (one descriptor per replacement)."""
    lifelines = DriverLifelines()
    try:
        address = lifelines.listen(None)
        key = lifelines.key.hex()
        dead = _python(started, LIFELINE_ACTOR, json.dumps(address), key)
        alive = _python(started, LIFELINE_ACTOR, json.dumps(address), key)
        assert _readline(dead) == "held\n"
        assert _readline(alive) == "held\n"
        assert lifelines.held == 2
        lifelines.prune()
        assert lifelines.held == 2, "a lifeline whose actor lives was closed"
        dead.kill()
        dead.wait(10)
        lifelines.prune()
        assert lifelines.held == 1
        time.sleep(0.3)
        assert alive.poll() is None, "the live actor lost its lifeline"
    finally:
        lifelines.close()


# --- end to end: a driver on a cluster that outlives it ---------------------------------------

DRIVER = textwrap.dedent(
    """
    import json, multiprocessing, sys, time
    import ray
    from executor_core import create_executor
    from executor_core.testing import conformance_config

    executor = create_executor(
        conformance_config(
            "ray",
            world_size=2,
            backend_options={"address": sys.argv[1], "log_to_driver": False},
        )
    )
    pids = executor.collective_rpc("get_pid")
    # A forked child holds this process's connection to Ray: Ray will not see it die.
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,))
    child.start()
    print(json.dumps({
        "pids": pids,
        "child": child.pid,
        "nodes": [p.node_id for p in executor.placements],
        "driver_node": ray.get_runtime_context().get_node_id(),
    }), flush=True)
    time.sleep(120)
    """
)


def _cluster_cpus_free(cpus: float, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0.0) >= cpus:
            return True
        time.sleep(0.1)
    return False


def test_actors_of_a_killed_driver_exit_within_2_s(
    ray_cluster: Cluster, started: list[Started]
) -> None:
    worker_nodes = {node.node_id for node in ray_cluster.worker_nodes}
    driver = _python(started, DRIVER, ray_cluster.address)
    try:
        line = _readline(driver)
        assert line, "the driver did not start"
        info = json.loads(line)
        child = psutil.Process(info["child"])
        started.append(child)
        pids: list[int] = info["pids"]
        # One actor on each worker node (1 CPU each), neither on the driver's node.
        assert set(info["nodes"]) == worker_nodes
        assert info["driver_node"] not in worker_nodes
        assert pids_alive(pids, within_s=0) == pids
        killed = time.monotonic()
        os.kill(driver.pid, signal.SIGKILL)
        alive = pids_alive(pids, within_s=WITHIN_S + 8)
        gone_s = time.monotonic() - killed
        print(f"actors {pids} of the SIGKILLed driver gone after {gone_s:.3f} s")
        assert alive == []
        assert gone_s < WITHIN_S
    finally:
        for process in started:  # the child too: then Ray sees the driver gone
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        driver.wait(10)
        # Leave the cluster as the next test expects it: Ray removes the dead job's
        # placement group once it noticed the driver's death.
        assert _cluster_cpus_free(2.0, within_s=20)
