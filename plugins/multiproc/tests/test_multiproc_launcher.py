"""The launcher contract (``executor_plugin_multiproc.launcher``): a placement that starts
the agents itself, on loopback "machines", with a driver that runs no ranks, several
executors in one process, an agent that never joins, and a placement that fails."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Any, ClassVar

import psutil
import pytest

from executor_channel import Secret
from executor_core import (
    ExecutorConfig,
    ExecutorError,
    ExecutorState,
    RecoveryPolicy,
    WorkerDiedError,
)
from executor_core.testing import conformance_config
from executor_core.testing._recovery import gloo_sum  # the kit's own gloo check
from executor_plugin_multiproc import MultiprocExecutor, MultiprocOptions
from executor_plugin_multiproc.launcher import AgentLaunch, Placement

#: Agents are processes that join over TCP: seconds per test.
pytestmark = pytest.mark.slow


class Machines(Placement):
    """Node N is the loopback address 127.0.0.(N+2); records what it was asked to do."""

    driver_runs_ranks: ClassVar[bool] = False
    #: Every instance, for the tests to look at (one per executor).
    made: ClassVar[list[Machines]] = []
    #: Extra arguments for the agent of a node (a bad flag makes it exit at once).
    extra: ClassVar[dict[int, list[str]]] = {}

    def __init__(self, config: ExecutorConfig, options: MultiprocOptions) -> None:
        super().__init__(config, options)
        self.jobs: dict[int, subprocess.Popen[bytes]] = {}
        self.launches: list[AgentLaunch] = []
        self.stopped: list[int] = []
        self.closed = 0
        Machines.made.append(self)

    def start(self, launch: AgentLaunch) -> None:
        node = launch.node_rank
        self.launches.append(launch)
        argv = [*launch.argv, "--node-id", f"machine-{node}", "--address", f"127.0.0.{node + 2}"]
        env = {k: v for k, v in os.environ.items() if k != Secret.ENV}
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # this test module
        self.jobs[node] = subprocess.Popen(
            [*argv, *self.extra.get(node, [])], env={**env, **launch.env}
        )

    def check(self, launch: AgentLaunch) -> None:
        code = self.jobs[launch.node_rank].poll()
        if code is not None:
            raise ExecutorError(f"the agent of node {launch.node_rank} exited with status {code}")

    def stop(self, launch: AgentLaunch) -> None:
        self.stopped.append(launch.node_rank)
        job = self.jobs[launch.node_rank]
        try:
            job.wait(10)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait()

    def close(self) -> None:
        self.closed += 1


class PlacedExecutor(MultiprocExecutor):
    placement_cls = Machines


class DriverRanks(Machines):
    driver_runs_ranks: ClassVar[bool] = True

    def node_id(self) -> str:
        return "machine-0"


class DriverRanksExecutor(MultiprocExecutor):
    placement_cls = DriverRanks


def _config(cls: type, world_size: int = 4, **overrides: Any) -> ExecutorConfig:
    options = {"shutdown_grace_s": 1.0, **overrides.pop("backend_options", {})}
    return conformance_config(
        cls, world_size=world_size, num_nodes=2, backend_options=options, **overrides
    )


def _placement_of(before: int) -> Machines:
    assert len(Machines.made) == before + 1
    return Machines.made[-1]


def _context(worker: Any) -> tuple[str, str, int, str]:
    context = worker.context
    return (
        context.node_id,
        context.node_address,
        context.local_rank,
        context.distributed_init_method,
    )


def test_every_rank_on_placed_machines_with_their_names_and_addresses() -> None:
    before = len(Machines.made)
    # No secret in this process's environment: the placement hands the executor's own.
    assert Secret.ENV not in os.environ
    with PlacedExecutor(_config(PlacedExecutor)) as executor:
        placement = _placement_of(before)
        seen = executor.collective_rpc(_context)
        pids = executor.collective_rpc("get_pid")
        # gloo across both machines, through the rendezvous on node 0's address
        assert executor.collective_rpc(gloo_sum, timeout=120) == [4.0] * 4
    nodes = [(node_id, address, local) for node_id, address, local, _ in seen]
    assert nodes == [
        ("machine-0", "127.0.0.2", 0),
        ("machine-0", "127.0.0.2", 1),
        ("machine-1", "127.0.0.3", 0),
        ("machine-1", "127.0.0.3", 1),
    ]
    # Node 0's agent hosts the torch rendezvous, at the address it stated.
    assert {init for *_, init in seen} == {seen[0][3]}
    assert seen[0][3].startswith("tcp://127.0.0.2:")
    assert os.getpid() not in pids  # the driver runs no rank
    assert [launch.node_rank for launch in placement.launches] == [0, 1]
    launch = placement.launches[0]
    assert launch.argv[1:4] == ("-m", "executor_core", "node")
    assert set(launch.env) == {Secret.ENV}
    assert launch.env[Secret.ENV] == launch.secret.hex()
    assert sorted(placement.stopped) == [0, 1]  # each started agent reaped once
    assert placement.closed == 1
    assert all(job.returncode == 0 for job in placement.jobs.values())


def test_driver_ranks_and_placed_agents_share_the_contract() -> None:
    before = len(Machines.made)
    with DriverRanksExecutor(_config(DriverRanksExecutor)) as executor:
        placement = _placement_of(before)
        pids = executor.collective_rpc("get_pid")
        nodes = [node for node, *_ in executor.collective_rpc(_context)]
    assert [launch.node_rank for launch in placement.launches] == [1]
    assert nodes == ["machine-0", "machine-0", "machine-1", "machine-1"]  # node 0: node_id()
    assert os.getpid() not in pids
    assert placement.stopped == [1]


def test_several_multi_node_executors_in_one_process() -> None:
    before = len(Machines.made)
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            with PlacedExecutor(_config(PlacedExecutor, world_size=2)) as executor:
                results[index] = executor.collective_rpc("echo", args=(index,))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert results == {i: [(0, (i,), {}), (1, (i,), {})] for i in range(3)}
    made = Machines.made[before:]
    assert len(made) == 3
    # Each executor its own secret and its own port.
    assert len({p.launches[0].secret.fingerprint for p in made}) == 3
    assert len({p.launches[0].address for p in made}) == 3


def test_an_agent_that_exits_before_joining_fails_the_start_at_once() -> None:
    before = len(Machines.made)
    Machines.extra[1] = ["--node-id", "has space"]  # a usage error: the agent exits with 2
    try:
        start = time.monotonic()
        with pytest.raises(ExecutorError, match="the agent of node 1 exited with status 2"):
            PlacedExecutor(_config(PlacedExecutor, backend_options={"startup_timeout": 120}))
        assert time.monotonic() - start < 20  # not startup_timeout
    finally:
        Machines.extra.clear()
    placement = _placement_of(before)
    assert sorted(placement.stopped) == [0, 1]  # the agent that had joined is reaped too
    assert all(job.poll() is not None for job in placement.jobs.values())


def test_a_killed_worker_on_a_placed_node_names_its_rank_and_node() -> None:
    before = len(Machines.made)
    executor = PlacedExecutor(_config(PlacedExecutor))
    try:
        placement = _placement_of(before)
        pids = executor.collective_rpc("get_pid")
        psutil.Process(pids[3]).kill()
        with pytest.raises(WorkerDiedError) as caught:
            executor.collective_rpc("sleep_s", args=(30.0,), timeout=30)
        assert caught.value.rank == 3
        assert "machine-1" in str(caught.value)
    finally:
        executor.shutdown()
    assert sorted(placement.stopped) == [0, 1]
    for job in placement.jobs.values():
        assert job.poll() is not None


def test_a_placement_reports_a_lost_agent_only_while_the_executor_runs() -> None:
    """``Placement.agent_lost``: before the start returned and after shutdown it does
    nothing; in between, the node's ranks' calls fail naming them, the node and the detail."""
    before = len(Machines.made)

    class EarlyReport(Machines):
        def start(self, launch: AgentLaunch) -> None:
            self.agent_lost(launch.node_rank, "reported during the start")
            super().start(launch)

    class EarlyExecutor(MultiprocExecutor):
        placement_cls = EarlyReport

    executor = EarlyExecutor(_config(EarlyExecutor))
    try:
        placement = _placement_of(before)
        assert executor.collective_rpc("get_rank") == [0, 1, 2, 3]  # the early report: no-op
        pending = executor.collective_rpc("slow", args=(30.0,), non_block=True)
        placement.agent_lost(1, "the scheduler preempted it")
        with pytest.raises(WorkerDiedError) as caught:
            pending.result(timeout=10)
        assert caught.value.ranks == (2, 3)
        assert caught.value.node == "machine-1"
        assert "the scheduler preempted it" in str(caught.value)
        assert executor.is_failed
    finally:
        executor.shutdown()
    placement.agent_lost(0, "after shutdown")  # nothing to fail: no error
    assert sorted(placement.stopped) == [0, 1]


def test_a_group_restart_keeps_the_placement_and_closes_it_once() -> None:
    """A recovery's group restart stops the agents and starts the next ones through the
    same placement (what it holds for all of them lives on); ``close`` runs once, at the
    end."""
    before = len(Machines.made)
    policy = RecoveryPolicy(backoff_s=0.0, replace_ranks=False)
    executor = PlacedExecutor(_config(PlacedExecutor, recovery=policy))
    try:
        placement = _placement_of(before)
        psutil.Process(executor.collective_rpc("get_pid")[3]).kill()
        deadline = time.monotonic() + 60
        while executor.last_recovery is None or executor.state is not ExecutorState.RUNNING:
            assert executor.state is not ExecutorState.FAILED, executor.failure
            assert time.monotonic() < deadline, "no recovery within 60 s"
            time.sleep(0.05)
        assert executor.last_recovery.kind == "restart"
        assert executor.collective_rpc("get_rank") == [0, 1, 2, 3]
        assert len(Machines.made) == before + 1  # no second placement
        assert [launch.node_rank for launch in placement.launches] == [0, 1, 0, 1]
        assert sorted(placement.stopped) == [0, 1]  # the first incarnation's agents
        assert placement.closed == 0
    finally:
        executor.shutdown()
    assert sorted(placement.stopped) == [0, 0, 1, 1]
    assert placement.closed == 1
