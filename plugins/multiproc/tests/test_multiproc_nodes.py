"""``mp`` across nodes: the conformance kit with a node agent per extra node, an agent or a
driver killed, agents refused, and garbage thrown at the driver's listener."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import attrs
import psutil
import pytest
from mp_nodes import Agents, agent_env, agents, node_secret
from mp_test_helpers import wait_gone

from executor_channel.testing import flood_unauthenticated, gate_token, throw_garbage
from executor_core import (
    ConfigError,
    Executor,
    ExecutorError,
    ExecutorState,
    NodeLostError,
    RecoveryPolicy,
    WorkerDiedError,
    create_executor,
)
from executor_core.backend import Registry, find_free_port
from executor_core.testing import (
    ExecutorConformanceTests,
    ExecutorFactory,
    conformance_config,
    layout_variant,
)

__all__ = ["agents", "node_secret"]  # fixtures, imported for the tests below

#: Node agents are separate processes that join over TCP with heartbeats: seconds per test.
pytestmark = pytest.mark.slow


class _TwoNodes(ExecutorConformanceTests):
    """Every executor with an even world size spans two nodes: this process and an agent."""

    backend = "mp"
    world_size = 2

    @pytest.fixture(scope="class")
    @classmethod
    def executor_factory(cls, agents: Agents) -> ExecutorFactory:  # type: ignore[override]
        def make(registry: Registry | None = None, **overrides: Any) -> Executor:
            config = cls.make_config(**overrides)
            if config.world_size % 2:
                return create_executor(config, registry)
            port = find_free_port()
            agents.start(port)
            options = {**config.backend_options, "node_port": port}
            config = attrs.evolve(config, num_nodes=2, backend_options=options)
            return create_executor(config, registry)

        return make


class TestTwoNodeConformance(_TwoNodes):
    """One tensor-parallel rank on each node (the kit kills the highest: the agent's)."""


@layout_variant
class TestTwoNodePipelineConformance(_TwoNodes):
    """Four ranks, two pipeline stages: one stage on each node; the tests that do not see
    the layout are TestTwoNodeConformance's alone (``layout_variant``)."""

    world_size = 4
    pipeline_parallel_size = 2


def _two_nodes(
    agents: Agents, world_size: int = 4, config: dict[str, Any] | None = None, **options: Any
) -> Executor:
    """An executor across two nodes (``config``: more of its config; ``options``: more
    backend options), an agent started for node 1."""
    port = find_free_port()
    agents.start(port)
    return create_executor(
        conformance_config(
            "mp",
            world_size=world_size,
            num_nodes=2,
            backend_options={"node_port": port, "shutdown_grace_s": 1.0, **options},
            **(config or {}),
        )
    )


@pytest.mark.usefixtures("node_secret")
class TestNodes:
    def test_ranks_are_contiguous_per_node(self, agents: Agents) -> None:
        with _two_nodes(agents) as executor:
            contexts = executor.collective_rpc("get_context")
            nodes = [c.node_id for c in contexts]
            assert nodes[0] == nodes[1] != nodes[2] == nodes[3]
            assert [c.local_rank for c in contexts] == [0, 1, 0, 1]
            assert {c.local_world_size for c in contexts} == {2}
            env = executor.collective_rpc("get_env", args=("LOCAL_RANK",))
            assert env == ["0", "1", "0", "1"]
            pids = executor.collective_rpc("get_pid")
            agent = agents.started[-1]
            # ranks 2 and 3 are the agent's children, not the driver's
            assert set(pids[2:]) <= {p.pid for p in psutil.Process(agent.pid).children()}
            assert not set(pids[2:]) & {p.pid for p in psutil.Process().children()}
        assert agent.wait(10) == 0

    def test_killed_agent_fails_calls_naming_its_ranks_and_node(self, agents: Agents) -> None:
        executor = _two_nodes(agents)
        try:
            pids = executor.collective_rpc("get_pid")
            pending = executor.collective_rpc("slow", args=(30.0,), non_block=True)
            time.sleep(0.2)
            killed_at = time.monotonic()
            agents.started[-1].kill()
            with pytest.raises(WorkerDiedError) as info:
                pending.result(timeout=10)
            took = time.monotonic() - killed_at
            assert took < 2.0, f"the loss of the node was seen after {took:.2f} s"
            assert info.value.ranks == (2, 3)
            assert info.value.node is not None
            assert "#1" in info.value.node
            assert "node" in str(info.value)
            # the agent's workers went with it
            assert wait_gone(pids[2:], 2.0) == []
            assert executor.is_failed
        finally:
            executor.shutdown()
        assert wait_gone(pids, 5.0) == []

    def test_a_lost_agent_comes_back_when_one_joins_again(self, agents: Agents) -> None:
        """With a recovery policy, a killed agent's node comes back once an agent for its node
        rank joins again (started by systemd, a scheduler or a person) within
        startup_timeout: its ranks are replaced there, and the driver's rank keeps its
        process. If none joins, the executor fails after that one attempt, with budget left
        (issue 48, item 6), naming the node that is gone."""
        port = find_free_port()
        agents.start(port)
        config = conformance_config(
            "mp",
            world_size=2,
            num_nodes=2,
            recovery=RecoveryPolicy(max_restarts=5, backoff_s=0.0),
            backend_options={"node_port": port, "shutdown_grace_s": 1.0, "startup_timeout": 10.0},
        )
        with create_executor(config) as executor:
            pids = executor.collective_rpc("get_pid", timeout=30)
            agents.started[-1].kill()
            deadline = time.monotonic() + 10
            while executor.state is ExecutorState.RUNNING:
                assert time.monotonic() < deadline, "the agent's death was not seen"
                time.sleep(0.01)
            time.sleep(1.0)  # the agent comes back a while later
            agents.start(port)
            assert executor.collective_rpc("get_rank", timeout=30) == [0, 1]
            assert executor.state is ExecutorState.RUNNING
            record = executor.last_recovery
            assert record is not None
            assert (record.kind, record.ranks) == ("replace", (1,)), record
            after = executor.collective_rpc("get_pid", timeout=30)
            assert after[0] == pids[0]
            assert after[1] != pids[1]
            # Lost again, and no agent comes: one bounded attempt, then the node is named.
            nodes = [c.node_id for c in executor.collective_rpc("get_context", timeout=30)]
            agents.started[-1].kill()
            deadline = time.monotonic() + 10
            while executor.state is ExecutorState.RUNNING:
                assert time.monotonic() < deadline, "the agent's death was not seen"
                time.sleep(0.01)
            seen = time.monotonic()
            deadline = seen + 40
            while executor.state is not ExecutorState.FAILED:
                assert time.monotonic() < deadline, f"still {executor.state}"
                time.sleep(0.05)
            took = time.monotonic() - seen
            failure = executor.failure
            assert isinstance(failure, NodeLostError), repr(failure)
            assert failure.ranks == (1,)
            assert failure.node == nodes[1], failure
            assert "did not join within startup_timeout=10" in str(failure)
            assert "start an agent for node rank 1" in str(failure)
            assert took < 10 + 8, f"more than one attempt: failed {took:.1f} s after the loss"

    def test_a_frozen_remote_rank_is_replaced_alone(self, agents: Agents) -> None:
        """A rank on another node frozen (SIGSTOP) in a call, with a recovery policy: the
        caller gets the hang as a death, the agent ends the process on the driver's order,
        and that ending is no second death: the rank is replaced, and the driver's rank
        keeps its process."""
        config = {"recovery": RecoveryPolicy(backoff_s=0.0), "hang_timeout_s": 2.0}
        with _two_nodes(agents, 2, config) as executor:
            pids = executor.collective_rpc("get_pid", timeout=30)
            call = executor.collective_rpc("slow", args=(1.0,), non_block=True)
            os.kill(pids[1], signal.SIGSTOP)
            with pytest.raises(WorkerDiedError, match="hung"):
                call.result(timeout=30)
            deadline = time.monotonic() + 30
            while executor.last_recovery is None or executor.state is not ExecutorState.RUNNING:
                assert time.monotonic() < deadline, f"not back: {executor.state}"
                time.sleep(0.05)
            assert (executor.last_recovery.kind, executor.last_recovery.ranks) == ("replace", (1,))
            after = executor.collective_rpc("get_pid", timeout=30)
            assert after[0] == pids[0]
            assert after[1] != pids[1]

    def test_agent_stopped_with_sigterm(self, agents: Agents) -> None:
        executor = _two_nodes(agents)
        try:
            pids = executor.collective_rpc("get_pid")
            pending = executor.collective_rpc("slow", args=(30.0,), non_block=True)
            agent = agents.started[-1]
            stopped_at = time.monotonic()
            agent.send_signal(signal.SIGTERM)
            with pytest.raises(WorkerDiedError, match="its agent was interrupted") as info:
                pending.result(timeout=10)
            assert time.monotonic() - stopped_at < 1.0  # said, not waited for
            assert info.value.ranks == (2, 3)
            assert agent.wait(5) == 130
            assert wait_gone(pids[2:], 2.0) == []
        finally:
            executor.shutdown()

    def test_worker_killed_on_another_node(self, agents: Agents) -> None:
        executor = _two_nodes(agents)
        try:
            pids = executor.collective_rpc("get_pid")
            pending = executor.collective_rpc("slow", args=(30.0,), non_block=True)
            os.kill(pids[3], signal.SIGKILL)
            with pytest.raises(WorkerDiedError) as info:
                pending.result(timeout=10)
            assert info.value.rank == 3
            assert info.value.signal == signal.SIGKILL
        finally:
            executor.shutdown()
        assert wait_gone(pids, 5.0) == []
        assert agents.started[-1].wait(5) is not None

    def test_refused_agent_and_join_timeout(self, agents: Agents) -> None:
        port = find_free_port()
        wrong = agents.start(port, node_rank=5, stderr=subprocess.PIPE)
        joined = agents.start(port, node_rank=1, stderr=subprocess.PIPE)
        config = conformance_config(
            "mp",
            world_size=3,
            num_nodes=3,
            backend_options={"node_port": port, "startup_timeout": 2.0},
        )
        started = time.monotonic()
        with pytest.raises(ExecutorError, match=r"node rank\(s\) \[2\] did not join"):
            create_executor(config)
        assert time.monotonic() - started < 5
        _, err = wrong.communicate(timeout=10)
        assert wrong.returncode == 2
        assert b"node rank 5 is out of range" in err
        # the node that had joined is released at once, not after its join timeout
        _, err = joined.communicate(timeout=5)
        assert joined.returncode == 2
        assert b"gave up before this node started" in err

    def test_agents_that_cannot_be_admitted_are_told_why_at_once(self, agents: Agents) -> None:
        port = find_free_port()
        twins = [agents.start(port, stderr=subprocess.PIPE) for _ in range(2)]  # node rank 1
        executor = create_executor(
            conformance_config(
                "mp",
                world_size=2,
                num_nodes=2,
                backend_options={"node_port": port, "shutdown_grace_s": 1.0},
            )
        )
        try:
            # One twin joined; the other is refused as soon as the driver reads its join.
            deadline = time.monotonic() + 10
            while all(a.poll() is None for a in twins) and time.monotonic() < deadline:
                time.sleep(0.05)
            (duplicate,) = [a for a in twins if a.poll() is not None]
            (serving,) = [a for a in twins if a is not duplicate]
            assert duplicate.returncode == 2
            assert executor.collective_rpc("get_rank") == [0, 1]
            late: dict[str, tuple[subprocess.Popen[bytes], float]] = {}
            for name, rank, extra in [
                ("late", 1, ()),
                ("out_of_range", 5, ()),
                ("other_num_nodes", 1, ("--num-nodes", "3")),
            ]:
                started = time.monotonic()
                agent = agents.start(
                    port, rank, join_timeout=120, stderr=subprocess.PIPE, extra=extra
                )
                late[name] = agent, started
            # The executor serves on while it answers them.
            for i in range(20):
                assert executor.collective_rpc("echo", args=(i,)) == [
                    (0, (i,), {}),
                    (1, (i,), {}),
                ]
            lines = {"duplicate": _refusal_line(duplicate)}
            for name, (agent, started) in late.items():
                lines[name] = _refusal_line(agent)
                took = time.monotonic() - started
                assert agent.returncode == 2, name
                # Told at once (the time is mostly its start-up): its --join-timeout is 120 s.
                assert took < 15, f"{name}: refused after {took:.1f} s"
            serving_pid = serving.pid
            assert f"has joined already (member pid {serving_pid} on " in lines["duplicate"]
            # Nothing else is awaited, whether the executor was starting or running by then.
            assert (
                "and awaits no member; each node rank takes one agent, and every one has its "
                "agent: stop this one"
            ) in lines["duplicate"]
            assert f"has joined already (member pid {serving_pid} on " in lines["late"]
            assert "the executor is running and awaits no member" in lines["late"]
            assert lines["late"].endswith("every one has its agent: stop this one")
            assert (
                "node rank 5 is out of range: this executor's members have node rank(s) 1 "
                "(num_nodes=2); start it with one of those node ranks (--node-rank)"
            ) in lines["out_of_range"]
            assert (
                "node rank 1 was started for num_nodes=3, and this executor has num_nodes=2"
            ) in lines["other_num_nodes"]
            assert executor.collective_rpc("get_rank") == [0, 1]
            assert serving.poll() is None
        finally:
            executor.shutdown()
        serving.communicate(timeout=10)
        assert serving.returncode == 0

    def test_world_size_must_divide(self, agents: Agents) -> None:
        with pytest.raises(ConfigError, match="multiple of num_nodes"):
            create_executor(conformance_config("mp", world_size=3, num_nodes=2))

    def test_unfinished_messages_hold_bounded_memory(self, agents: Agents) -> None:
        """Peers without the secret stream 256 MiB parts of messages they never finish, and
        others garbage, at the driver's listener: the driver grows by at most tens of MiB
        (docs/security.md) and calls go on."""
        executor = _two_nodes(agents, world_size=2)
        try:
            port = executor.config.backend_options["node_port"]
            result: list[dict[str, int]] = []
            attack = threading.Thread(
                target=lambda: result.append(
                    flood_unauthenticated(f"tcp://127.0.0.1:{port}", 6.0, connections=6)
                )
            )
            baseline = peak = _rss_bytes()
            attack.start()
            calls = 0
            while attack.is_alive():
                assert executor.collective_rpc("echo", args=(calls,), timeout=30) == [
                    (0, (calls,), {}),
                    (1, (calls,), {}),
                ]
                calls += 1
                peak = max(peak, _rss_bytes())
            attack.join(30)
            assert result, "the attack did not finish"
            assert result[0]["bytes"] > 64 << 20, result
            assert calls > 10
            # The attack's threads send from one 1 MiB block: what grows is the listener.
            assert peak - baseline < 32 << 20, (peak - baseline) >> 20
            assert executor.collective_rpc("get_rank") == [0, 1]
        finally:
            executor.shutdown()

    def test_garbage_at_the_listener_is_dropped_and_calls_go_on(self, agents: Agents) -> None:
        executor = _two_nodes(agents, world_size=2)
        port = executor.config.backend_options["node_port"]
        sent = 0
        try:
            stop = threading.Event()
            counts: list[int] = []

            def calls() -> None:
                done = 0
                while not stop.is_set():
                    assert executor.collective_rpc("echo", args=(done,)) == [
                        (0, (done,), {}),
                        (1, (done,), {}),
                    ]
                    done += 1
                counts.append(done)

            caller = threading.Thread(target=calls)
            caller.start()
            listener = executor.transport.hub._listener  # type: ignore[attr-defined]
            sent = throw_garbage(f"tcp://127.0.0.1:{port}", gate_token(listener), 10_000)
            _wait_for_drops(listener, 10_000)
            stop.set()
            caller.join(30)
            assert counts
            assert counts[0] > 0
            assert executor.collective_rpc("get_rank") == [0, 1]
        finally:
            executor.shutdown()
        assert sent >= 10_000


def _refusal_line(agent: subprocess.Popen[bytes]) -> str:
    """The one line of stderr in which a refused agent says why (it must have exited or
    exit within 10 s); no traceback."""
    _, err = agent.communicate(timeout=10)
    text = err.decode()
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if " refused node rank " in line]
    assert len(lines) == 1, text
    return lines[0]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _wait_for_drops(listener: Any, count: int) -> None:
    """Wait (up to 30 s) until the listener has dropped ``count`` frames: every one sent."""
    deadline = time.monotonic() + 30
    while sum(listener.drops.values()) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sum(listener.drops.values()) >= count, listener.drops


DRIVER = textwrap.dedent(
    """
    import json, sys, time
    from executor_core import create_executor
    from executor_core.testing import conformance_config

    if __name__ == "__main__":
        executor = create_executor(conformance_config(
            "mp", world_size=2, num_nodes=2, backend_options={"node_port": int(sys.argv[1])}
        ))
        print(json.dumps(executor.collective_rpc("get_pid")), flush=True)
        executor.collective_rpc("slow", args=(60.0,))
    """
)


@pytest.mark.usefixtures("node_secret")
def test_killed_driver_stops_every_node(agents: Agents, tmp_path: Any) -> None:
    port = find_free_port()
    agent = agents.start(port)
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    driver = subprocess.Popen(
        [sys.executable, str(script), str(port)],
        stdout=subprocess.PIPE,
        env=agent_env(os.environ["EXECUTOR_CHANNEL_SECRET"]),
        text=True,
    )
    try:
        assert driver.stdout is not None
        line = driver.stdout.readline()
        assert line, "the driver did not start"
        pids = json.loads(line)
        time.sleep(0.2)
        killed_at = time.monotonic()
        driver.kill()
        driver.wait(10)
        assert wait_gone([agent.pid, *pids], 2.0) == [], "a node outlived its driver by 2 s"
        took = time.monotonic() - killed_at
        assert took < 2.0
        assert agent.wait(1) == 3  # DRIVER_LOST_EXIT
    finally:
        if driver.poll() is None:
            driver.kill()
        driver.communicate(timeout=10)


ONE_NODE = textwrap.dedent(
    """
    import sys
    from executor_core import create_executor
    from executor_core.testing import conformance_config

    def zmq_loaded(worker):
        return "zmq" in sys.modules

    if __name__ == "__main__":
        with create_executor(conformance_config("mp", world_size=2)) as executor:
            print("zmq" in sys.modules, executor.collective_rpc(zmq_loaded))
    """
)


def test_one_node_never_imports_zmq(tmp_path: Any) -> None:
    """The network half of the channel costs nothing to an executor on one machine."""
    script = tmp_path / "one_node.py"
    script.write_text(ONE_NODE)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "False [False, False]", done.stdout + done.stderr
