"""Warm spares: with a recovery policy, a node keeps an idle worker process, its worker's
module imported, and a rank replacement runs in it instead of starting a process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import psutil
import pytest
from mp_nodes import Agents, agents, node_secret
from mp_test_helpers import shm_unchanged, wait_gone
from mp_test_workers import ImportTimeWorker

from executor_core import Executor, ExecutorState, RecoveryPolicy, create_executor
from executor_core.backend import find_free_port
from executor_core.testing import conformance_config

__all__ = ["agents", "node_secret", "shm_unchanged"]  # fixtures, imported for the tests below

pytestmark = pytest.mark.usefixtures("shm_unchanged")

#: Seconds a spare may take to start and import its worker's module.
SPARE_START_S = 30.0


def make(recovery: bool = True, num_nodes: int = 1, **options: Any) -> Executor:
    return create_executor(
        conformance_config(
            "mp",
            world_size=2,
            num_nodes=num_nodes,
            worker_cls=ImportTimeWorker,
            recovery=RecoveryPolicy(backoff_s=0.0) if recovery else None,
            backend_options={"shutdown_grace_s": 1.0, **options},
        )
    )


def spares(parent: int | None = None) -> list[int]:
    """PIDs of the spare processes among ``parent``'s children (a spare names itself)."""
    found = []
    for child in psutil.Process(parent).children():
        try:
            if child.name() == "mp-spare":
                found.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def wait_spare(not_pid: int | None = None, parent: int | None = None) -> int:
    deadline = time.monotonic() + SPARE_START_S
    while time.monotonic() < deadline:
        found = [pid for pid in spares(parent) if pid != not_pid]
        if found:
            return found[0]
        time.sleep(0.02)
    raise AssertionError(f"no spare process within {SPARE_START_S:g} s")


def kill_and_recover(executor: Executor, pid: int) -> list[int]:
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while executor.state is ExecutorState.RUNNING:  # until the death is seen
        assert time.monotonic() < deadline
        time.sleep(0.001)
    while executor.state is not ExecutorState.RUNNING:
        assert executor.state is not ExecutorState.FAILED, executor.failure
        assert time.monotonic() < deadline, "not back within 60 s"
        time.sleep(0.01)
    pids: list[int] = executor.collective_rpc("get_pid", timeout=30)
    return pids


def test_a_replacement_runs_in_the_spare_and_a_new_spare_follows() -> None:
    executor = make()
    try:
        pids = executor.collective_rpc("get_pid")
        spare = wait_spare()
        time.sleep(0.5)  # let it finish its imports (it would take the rank either way)
        killed_at = time.time()
        after = kill_and_recover(executor, pids[1])
        assert after == [pids[0], spare], "rank 1 did not run in the spare"
        imported = executor.collective_rpc("imported_at")
        assert imported[1] < killed_at, "the spare had not imported the worker's module"
        assert executor.collective_rpc("get_rank") == [0, 1]
        second = wait_spare(not_pid=spare)
        assert kill_and_recover(executor, spare) == [pids[0], second]
    finally:
        executor.shutdown()
    assert wait_gone([*pids, spare], 5.0) == []
    assert spares() == [], "a spare outlived its executor"


@pytest.mark.parametrize(
    "settings",
    [{"recovery": False}, {"spare_workers": 0}, {"start_method": "fork"}],
    ids=["without-recovery", "spare_workers=0", "fork"],
)
def test_no_spare_unless_recovery_can_use_one(settings: dict[str, Any]) -> None:
    executor = make(**settings)
    try:
        pids = executor.collective_rpc("get_pid")
        time.sleep(1.0)  # a spare starts at once after start-up
        assert spares() == []
        if settings.get("recovery", True):
            killed_at = time.time()
            after = kill_and_recover(executor, pids[1])
            assert after[0] == pids[0]
            assert after[1] not in pids
            if "start_method" not in settings:  # a forked worker has the driver's modules
                assert executor.collective_rpc("imported_at")[1] > killed_at
    finally:
        executor.shutdown()


def test_a_dead_spare_leaves_the_replacement_a_new_process() -> None:
    executor = make()
    try:
        pids = executor.collective_rpc("get_pid")
        spare = wait_spare()
        os.kill(spare, signal.SIGKILL)
        assert wait_gone([spare], 5.0) == []
        after = kill_and_recover(executor, pids[1])
        assert after[0] == pids[0]
        assert after[1] not in (pids[1], spare)
        assert executor.collective_rpc("get_rank") == [0, 1]
    finally:
        executor.shutdown()
    assert spares() == []


@pytest.mark.slow  # a node agent
@pytest.mark.usefixtures("node_secret")
def test_a_node_agent_hands_its_dead_rank_to_its_spare(agents: Agents) -> None:
    port = find_free_port()
    agent = agents.start(port)
    executor = make(num_nodes=2, node_port=port)
    try:
        pids = executor.collective_rpc("get_pid")  # rank 1 on the agent's node
        spare = wait_spare(parent=agent.pid)
        time.sleep(0.5)  # its imports done
        killed_at = time.time()
        assert kill_and_recover(executor, pids[1]) == [pids[0], spare]
        assert executor.collective_rpc("imported_at")[1] < killed_at
        wait_spare(not_pid=spare, parent=agent.pid)
    finally:
        executor.shutdown()
    assert agent.wait(10) == 0
    assert wait_gone([*pids, spare], 5.0) == []


DRIVER = textwrap.dedent(
    """
    import json, time
    from executor_core import RecoveryPolicy, create_executor
    from executor_core.testing import conformance_config

    executor = create_executor(conformance_config("mp", world_size=2, recovery=RecoveryPolicy()))
    print(json.dumps(executor.collective_rpc("get_pid")), flush=True)
    time.sleep(60)
    """
)


def test_a_killed_driver_takes_its_spare_with_it() -> None:
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    spare = None
    try:
        assert driver.stdout is not None
        pids = json.loads(driver.stdout.readline())
        spare = wait_spare(parent=driver.pid)
        driver.kill()
        driver.wait(10)
        assert wait_gone([*pids, spare], 2.0) == [], "the spare outlived its driver by 2 s"
    finally:
        driver.kill()
        driver.communicate(timeout=10)
        if spare is not None and wait_gone([spare], 0):
            os.kill(spare, signal.SIGKILL)
