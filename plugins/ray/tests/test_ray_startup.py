"""Without a Ray connection the backend starts a local instance, and cleans up after it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil  # type: ignore[import-untyped]  # psutil ships no type information
import pytest
import ray

from executor_core import create_executor
from executor_core.testing import conformance_config
from executor_plugin_ray import _cluster

pytestmark = pytest.mark.usefixtures("no_ray")

HOME_TOKEN = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")


def _processes_using(path: str) -> list[int]:
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            uses = any(path in part for part in proc.info["cmdline"] or ())
            if uses and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


def _wait_gone(pids: list[int], within: float) -> list[int]:
    deadline = time.monotonic() + within
    alive = pids
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                continue
        if not alive:
            break
        time.sleep(0.2)
    return alive


def _describe(pids: list[int]) -> str:
    lines = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            lines.append(f"{pid} ({proc.status()}): {' '.join(proc.cmdline())[:200]}")
        except psutil.Error:
            lines.append(f"{pid}: gone")
    return "\n".join(lines)


def test_local_instance_is_shared_and_stopped_by_the_last_executor() -> None:
    had_home_token = os.path.exists(HOME_TOKEN)
    token_env = os.environ.get("RAY_AUTH_TOKEN")
    auth_mode_env = os.environ.get("RAY_AUTH_MODE")
    # Half a CPU per worker: two executors of two workers fit on a 2-CPU machine's instance.
    options = {"log_to_driver": False, "num_cpus_per_worker": 0.5}
    config = conformance_config("ray", world_size=2, backend_options=options)
    # Children from earlier tests (a forkserver, multiprocessing's resource tracker) live as
    # long as this process: only what the executor starts is Ray's.
    earlier = {p.pid for p in psutil.Process().children(recursive=True)}
    first = create_executor(config)
    temp_dir = _cluster._state.temp_dir
    try:
        assert ray.is_initialized()
        assert temp_dir is not None
        assert os.path.basename(temp_dir).startswith("executor-ray-")
        assert os.path.isdir(os.path.join(temp_dir, "session_latest"))
        ray_pids = [
            p.pid for p in psutil.Process().children(recursive=True) if p.pid not in earlier
        ]
        second = create_executor(config)
        try:
            first.shutdown()
            assert ray.is_initialized(), "the second executor still uses the instance"
            assert second.collective_rpc("get_rank") == [0, 1]
        finally:
            second.shutdown()
    finally:
        first.shutdown()
    assert not ray.is_initialized()
    assert not os.path.exists(temp_dir)
    survivors = _wait_gone(ray_pids, within=10)
    assert survivors == [], _describe(survivors)
    assert os.path.exists(HOME_TOKEN) == had_home_token, "no token written to ~/.ray"
    assert os.environ.get("RAY_AUTH_TOKEN") == token_env
    assert os.environ.get("RAY_AUTH_MODE") == auth_mode_env, "ray.init's auth mode undone"


DRIVER = textwrap.dedent(
    """
    import sys, time
    from executor_core import create_executor
    from executor_core.testing import conformance_config
    from executor_plugin_ray import _cluster

    executor = create_executor(
        conformance_config("ray", world_size=1, backend_options={"log_to_driver": False})
    )
    assert executor.collective_rpc("get_rank") == [0]
    print(_cluster._state.temp_dir, flush=True)
    time.sleep(120)
    """
)


def test_killed_driver_leaves_no_ray_process_or_temp_dir() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True, start_new_session=True
    ) as driver:
        try:
            assert driver.stdout is not None
            temp_dir = driver.stdout.readline().strip()
            assert temp_dir, "the driver did not start"
            started = [p.pid for p in psutil.Process(driver.pid).children(recursive=True)]
            assert len(started) >= 4  # gcs, raylet, agents, the worker, the reaper...
            os.kill(driver.pid, signal.SIGKILL)
            driver.wait(10)
            survivors = _wait_gone(started, within=20)
            assert survivors == [], _describe(survivors)
            assert _processes_using(temp_dir) == []
            assert not os.path.exists(temp_dir)
        finally:
            if driver.poll() is None:
                driver.kill()
                driver.wait(10)
