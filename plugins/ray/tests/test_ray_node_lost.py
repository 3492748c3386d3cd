"""The raylet of the driver's own node dies: the recovery stops at once with
:class:`NodeLostError` naming the node, rather than cycling through replacement and group
restart attempts that each wait ``startup_timeout`` (issue 48, item 2).

It runs in a process of its own, with a Ray instance of its own (the backend's local one):
killing a raylet would end the session the other tests share. Ray is told to miss fewer
heartbeats before it marks a node dead (its own settings, through the environment), so that
the death is seen in seconds rather than Ray's default 15 or so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from executor_core.testing._guard import pids_alive

pytestmark = pytest.mark.slow

DRIVER = textwrap.dedent(
    """
    import json, os, time
    import psutil
    from executor_core import ExecutorState, RecoveryPolicy, create_executor
    from executor_core.testing import conformance_config

    config = conformance_config(
        "ray",
        world_size=2,
        recovery=RecoveryPolicy(backoff_s=0.5),
        backend_options={"startup_timeout": 60, "local_num_cpus": 4},
    )
    executor = create_executor(config)
    assert executor.collective_rpc("get_rank", timeout=30) == [0, 1]
    mine = psutil.Process().children(recursive=True)
    [raylet] = [p for p in mine if p.name() == "raylet"]
    raylet.kill()
    killed = time.monotonic()
    while executor.state is ExecutorState.RUNNING and time.monotonic() - killed < 60:
        time.sleep(0.05)
    seen = time.monotonic()
    while executor.state is ExecutorState.RECOVERING and time.monotonic() - seen < 120:
        time.sleep(0.05)
    failed = time.monotonic()
    try:
        executor.collective_rpc("get_rank", timeout=10)
        outcome = "ok"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    failure = executor.failure
    executor.shutdown()
    print(json.dumps({
        "state": str(executor.state),
        "seen_s": seen - killed,
        "ended_s": failed - seen,
        "outcome": outcome,
        "failure": type(failure).__name__,
        "node": getattr(failure, "node", None),
        "pids": {p.pid: " ".join(p.cmdline()[:3]) for p in mine if p.is_running()},
    }), flush=True)
    """
)


def test_a_dead_raylet_on_the_drivers_node_ends_the_recovery_at_once() -> None:
    env = {
        **os.environ,
        # Ray's own settings (RAY_<name>): a node missing 3 checks 0.5 s apart is dead.
        "RAY_health_check_period_ms": "500",
        "RAY_health_check_timeout_ms": "500",
        "RAY_health_check_failure_threshold": "3",
    }
    run = subprocess.run(
        [sys.executable, "-c", DRIVER],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    # The death is Ray's to see; once seen, the recovery ends within one check, not after
    # attempts that each wait startup_timeout (60 s here).
    assert report["ended_s"] < 10, report
    assert report["failure"] == "NodeLostError", report
    assert report["outcome"].startswith("NodeLostError: node "), report
    assert "this driver's own Ray node" in report["outcome"], report
    assert "restart the driver process" in report["outcome"], report
    assert report["node"], report
    assert "startup_timeout" not in report["outcome"], report
    left = pids_alive([int(pid) for pid in report["pids"]], 15.0)
    named = {pid: report["pids"][str(pid)] for pid in left}
    assert not left, f"processes of the driver's Ray session still run: {named}"
