"""The slurm backend against a real Slurm: where the agents and ranks run (from a login node,
within salloc, within sbatch with the driver on node 0), what each failure says (a refused
or pending allocation, a failing step, scancel, a lost node, a killed driver), and the
secret's privacy. Every test leaves no job or process behind (the ``slurm`` fixture)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from slurm_cluster import SlurmCluster, alive, wait_for

from executor_core import (
    Executor,
    ExecutorConfig,
    ExecutorError,
    ExecutorState,
    RecoveryPolicy,
    WorkerDiedError,
    create_executor,
)

pytestmark = pytest.mark.slow

WORKER = "executor_core.testing:ConformanceWorker"


def _config(world_size: int = 2, **backend_options: Any) -> ExecutorConfig:
    return ExecutorConfig(
        backend="slurm",
        worker_cls=WORKER,
        tensor_parallel_size=world_size,
        num_nodes=2,
        rpc_timeout=60.0,
        backend_options=backend_options,
    )


def _where(executor: Executor) -> list[tuple[str, int]]:
    """Each rank's node id and its process's parent."""
    return executor.collective_rpc(lambda w: (w.context.node_id, os.getppid()))


@pytest.fixture
def executor(slurm: SlurmCluster) -> Iterator[Executor]:
    """Two ranks over n1 and n2, from this process (a login node: it asks for the job)."""
    ex = create_executor(_config())
    try:
        yield ex
    finally:
        ex.shutdown()


def _job(slurm: SlurmCluster) -> str:
    jobs = [line.split() for line in slurm.jobs()]
    running = [job for job, state, _ in jobs if state == "RUNNING"]
    assert len(running) == 1, jobs
    return running[0]


# --- where things run --------------------------------------------------------------------------


def test_from_a_login_node_the_job_is_asked_for_and_released(slurm: SlurmCluster) -> None:
    with create_executor(_config(world_size=4)) as ex:
        where = _where(ex)
        assert [node for node, _ in where] == ["n1", "n1", "n2", "n2"]
        assert all(parent != os.getpid() for _, parent in where)  # no rank here
        job = _job(slurm)
        steps = slurm.run("squeue", "--noheader", "--steps", f"--jobs={job}", "--format=%i %N")
        assert sorted(steps.split()) == sorted([f"{job}.0", "n1", f"{job}.1", "n2"])
    assert not [line for line in slurm.jobs() if "RUNNING" in line]  # released


def test_within_salloc_the_steps_run_in_that_job(
    slurm: SlurmCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    slurm.run("salloc", "--no-shell", "--nodes=2", "--job-name=outer")
    job = _job(slurm)
    try:
        # What a salloc shell holds: the job, its nodes; no SLURMD_NODENAME (not on a node).
        monkeypatch.setenv("SLURM_JOB_ID", job)
        monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
        with create_executor(_config()) as ex:
            assert [node for node, _ in _where(ex)] == ["n1", "n2"]
            assert len(slurm.jobs()) == 1  # no allocation of its own
        steps = slurm.run("squeue", "--noheader", "--steps", f"--jobs={job}")
        assert not steps.strip(), steps  # its steps ended; the job is the user's
        assert _job(slurm) == job
    finally:
        slurm.run("scancel", job)


_DRIVER = """
import json, os, socket, sys
from executor_core import ExecutorConfig, create_executor

if __name__ == "__main__":  # its workers are spawned: they import this file
    options = json.loads(sys.argv[1])
    config = ExecutorConfig(backend="slurm", worker_cls="{worker}", tensor_parallel_size=2,
                            num_nodes=2, rpc_timeout=60.0, backend_options=options)
    with create_executor(config) as ex:
        where = ex.collective_rpc(lambda w: (w.context.node_id, os.getppid()))
    print(json.dumps({{"pid": os.getpid(), "node": os.environ["SLURMD_NODENAME"],
                      "host": socket.gethostname(), "where": where}}))
"""


def _sbatch(slurm: SlurmCluster, tmp_path: Path, options: dict[str, Any]) -> dict[str, Any]:
    """Run the driver as a batch job of two nodes (its script runs on the first, n1)."""
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER.format(worker=WORKER))
    log = tmp_path / "job.out"
    wrap = f"exec {sys.executable} {script} '{json.dumps(options)}'"
    argv = ["sbatch", "--wait", "--nodes=2", f"--output={log}", f"--chdir={tmp_path}"]
    done = subprocess.run(
        [*argv, f"--wrap={wrap}"], env=slurm.env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr + (log.read_text() if log.exists() else "")
    lines = log.read_text().splitlines()
    result: dict[str, Any] = json.loads(next(line for line in lines if line.startswith("{")))
    return result


def test_within_sbatch_the_driver_runs_node_0s_ranks(slurm: SlurmCluster, tmp_path: Path) -> None:
    """On n1 (SLURMD_NODENAME in the batch script) the driver holds node 0's rank itself
    and places one agent, on n2."""
    result = _sbatch(slurm, tmp_path, {})
    assert result["node"] == "n1"
    (node0, parent0), (node1, parent1) = result["where"]
    assert parent0 == result["pid"]  # rank 0 is the driver's own worker
    # The driver's node is named as Slurm names it (the placement's node_id).
    assert node0 == "n1"
    assert node1 == "n2"
    assert parent1 != result["pid"]


def test_a_lost_agent_comes_back_in_a_new_step_of_the_same_job(slurm: SlurmCluster) -> None:
    """n2's agent killed (its step ends), with a recovery policy: n2's rank is replaced in a
    new step of the same job (no second salloc), on n2 again, while n1's worker keeps its
    process; the job is released once, at shutdown."""
    config = attrs.evolve(_config(), recovery=RecoveryPolicy(backoff_s=0.0))
    with create_executor(config) as ex:
        job = _job(slurm)
        pids = ex.collective_rpc(lambda w: os.getpid())
        agent = next(
            pid
            for pid, cmd in slurm.processes().items()
            # The agent itself, not the srun whose command line holds the agent's
            if cmd.startswith(f"{sys.executable} -m executor_core node") and "--node-id n2" in cmd
        )
        os.kill(agent, signal.SIGKILL)
        wait_for(
            "the executor is back",
            lambda: ex.last_recovery is not None and ex.state is ExecutorState.RUNNING,
            60.0,
        )
        assert ex.last_recovery is not None
        assert (ex.last_recovery.kind, ex.last_recovery.ranks) == ("replace", (1,))
        assert [node for node, _ in _where(ex)] == ["n1", "n2"]
        after = ex.collective_rpc(lambda w: os.getpid())
        assert after[0] == pids[0]
        assert after[1] != pids[1]
        assert _job(slurm) == job  # the same allocation, and no other
        steps = slurm.run("squeue", "--noheader", "--steps", f"--jobs={job}", "--format=%i")
        assert sorted(steps.split()) == [f"{job}.0", f"{job}.2"]  # n1's, and n2's new one
    assert not [line for line in slurm.jobs() if "RUNNING" in line]  # released


def test_within_sbatch_driver_runs_ranks_false_places_every_node(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    result = _sbatch(slurm, tmp_path, {"driver_runs_ranks": False})
    assert [node for node, _ in result["where"]] == ["n1", "n2"]
    assert all(parent != result["pid"] for _, parent in result["where"])


def test_driver_runs_ranks_true_off_the_allocation_is_refused(slurm: SlurmCluster) -> None:
    with pytest.raises(ExecutorError, match="runs on no node of a Slurm allocation"):
        create_executor(_config(driver_runs_ranks=True))


# --- what each failure says ------------------------------------------------------------------


def test_a_refused_allocation_says_what_slurm_said(slurm: SlurmCluster) -> None:
    with pytest.raises(ExecutorError, match=r"Slurm refused the allocation: .*nope"):
        create_executor(_config(partition="nope"))


def test_an_allocation_pending_past_its_bound_says_why(slurm: SlurmCluster) -> None:
    slurm.run("salloc", "--no-shell", "--nodes=2", "--exclusive", "--job-name=blocker")
    blocker = _job(slurm)
    try:
        start = time.monotonic()
        with pytest.raises(ExecutorError, match=r"did not grant job \d+ .*reason Resources"):
            create_executor(_config(pending_timeout_s=2.0))
        assert time.monotonic() - start < 15
        wait_for("the request cancelled", lambda: len(slurm.jobs()) == 1, 10.0)
    finally:
        slurm.run("scancel", blocker)


def test_a_failing_step_says_what_srun_said(slurm: SlurmCluster) -> None:
    start = time.monotonic()
    with pytest.raises(ExecutorError, match=r"srun step of node 0 \(n1, job \d+\).*srun: error"):
        create_executor(_config(srun_args=["--cpus-per-task=99"]))
    assert time.monotonic() - start < 20


def test_scancel_fails_the_call_naming_ranks_and_node(slurm: SlurmCluster) -> None:
    ex = create_executor(_config(world_size=4))
    try:
        job = _job(slurm)
        threading.Timer(1.0, slurm.run, ("scancel", job)).start()
        start = time.monotonic()
        with pytest.raises(WorkerDiedError) as info:
            ex.collective_rpc(lambda w: time.sleep(60))
        took = time.monotonic() - start
        error = info.value
        assert took < 10, took
        assert error.node in ("n1", "n2")
        assert error.ranks == ((0, 1) if error.node == "n1" else (2, 3))
        assert f"on node {error.node}" in str(error)
        assert ex.is_failed
    finally:
        ex.shutdown()


def test_a_lost_node_is_reported_with_what_slurm_said(slurm: SlurmCluster) -> None:
    """slurmd of n2 killed: Slurm declares n2 lost (SlurmdTimeout) and ends the job; the
    executor fails naming n2 and its rank, with srun's words."""
    ex = create_executor(_config())
    try:
        slurm.kill_slurmd("n2")
        deadline = time.monotonic() + 90
        with contextlib.suppress(WorkerDiedError):
            while time.monotonic() < deadline:
                ex.collective_rpc("get_rank")
                time.sleep(0.2)
        error = ex.failure
        assert isinstance(error, WorkerDiedError), error
        assert error.node == "n2"
        assert error.ranks == (1,)
        assert "Node failure on n2" in str(error)
    finally:
        ex.shutdown()
        slurm.start_slurmd("n2")  # it cleans up the step it lost track of
        slurm.wait_idle(60.0)


_HOLDER = """
import sys
from executor_core import ExecutorConfig, create_executor
config = ExecutorConfig(backend="slurm", worker_cls="{worker}", tensor_parallel_size=2,
                        num_nodes=2)
ex = create_executor(config)
print("ready", flush=True)
sys.stdin.read()
"""


def test_a_killed_driver_leaves_no_job_or_process(slurm: SlurmCluster) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", _HOLDER.format(worker=WORKER)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as driver:
        try:
            assert driver.stdout is not None
            assert driver.stdout.readline().strip() == "ready"
            assert _job(slurm)
            assert any("executor_core node" in cmd for cmd in slurm.processes().values())
            driver.send_signal(signal.SIGKILL)
            driver.wait(10)
            # salloc lets go of the job; the agents see their driver go silent.
            slurm.assert_clean(15.0)
        finally:
            if alive(driver.pid):
                driver.kill()


# --- the secret ----------------------------------------------------------------------------


def test_the_secret_is_in_no_command_line_job_record_or_file(
    slurm: SlurmCluster, executor: Executor
) -> None:
    agents = [
        pid
        for pid, cmd in slurm.processes().items()
        if cmd.startswith(f"{sys.executable} -m executor_core node")  # not srun's
    ]
    assert len(agents) == 2
    environ = Path(f"/proc/{agents[0]}/environ").read_bytes().split(b"\0")
    secret = next(v for v in environ if v.startswith(b"EXECUTOR_CHANNEL_SECRET="))
    secret = secret.split(b"=", 1)[1]
    assert len(secret) >= 16
    job = _job(slurm)
    seen = [
        subprocess.run(["ps", "-eo", "args"], capture_output=True, check=True).stdout,
        slurm.run("scontrol", "show", "job", "--details", job).encode(),
        slurm.run("scontrol", "show", "step", job).encode(),
        slurm.run("squeue", "--steps", "--format=%all").encode(),
    ]
    for output in seen:
        assert secret not in output
    for path in slurm.root.rglob("*"):
        if path.is_file() and not path.is_socket():
            assert secret not in path.read_bytes(), path
    # An agent's environment is readable by its owner alone.
    assert oct(Path(f"/proc/{agents[0]}/environ").stat().st_mode & 0o777) == "0o400"


# --- the main job --------------------------------------------------------------------------

_CLI = ["--model-size", "tiny", "--requests", "4", "--prompt-len", "5", "--max-new-tokens", "4"]


def _run(tmp_path: Path, name: str, *args: str) -> list[Any]:
    out = tmp_path / f"{name}.json"
    argv = [sys.executable, "-m", "executor_core", "run", *_CLI, "--no-progress", *args]
    done = subprocess.run(
        [*argv, "--output-json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    tokens: list[Any] = json.loads(out.read_text())["tokens"]
    return tokens


def test_the_main_job_gives_mps_tokens_across_two_slurm_nodes(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    layout = ["--tp", "2", "--pp", "2"]
    expected = _run(tmp_path, "mp", "--backend", "mp", *layout)
    got = _run(tmp_path, "slurm", "--backend", "slurm", "--num-nodes", "2", *layout)
    assert got == expected
