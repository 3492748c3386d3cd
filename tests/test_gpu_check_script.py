"""scripts/gpu_check.py, the GPU check a person with one GPU runs: its dry run on the CPU lists
every check, runs the ones that need no GPU and passes; its exit status reports a failure.

The whole dry run is run once, from the offline bundle (tests/test_gpu_bundle.py, checked by
:func:`assert_full_dry_run`); here only its Ray check, which needs this environment's Ray."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"

#: Every check, in the order the script runs them (docs/gpu.md describes each).
CHECKS = [
    "tokens",
    "tokens_tp2",
    "sleep_wake",
    "timing",
    "device_per_thread_uni",
    "device_per_thread_mp",
    "device_per_thread_ray",
    "one_gpu_per_rank",
    "recovery_nccl",
    "fork_after_cuda",
]
#: What the dry run must really run, and pass, on the CPU.
RUN_ON_CPU = {
    "tokens",
    "sleep_wake",
    "timing",
    "device_per_thread_uni",
    "device_per_thread_mp",
    "one_gpu_per_rank",
}
#: What only a GPU can run: listed as SKIP in the dry run.
CUDA_ONLY = {"tokens_tp2", "recovery_nccl", "fork_after_cuda"}
#: The script's own promise is under a minute on two cores; this leaves room for a busy host.
TIMEOUT_S = 240


def _run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=tmp_path,
        check=False,
    )
    assert out.is_file(), f"no --json report\n{proc.stdout}\n{proc.stderr}"
    report: dict[str, Any] = json.loads(out.read_text())
    return proc, report


def assert_full_dry_run(stdout: str, report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """What a whole dry run (no ``--only``) must show: every check listed in order, those that
    need no GPU really run and passed, the CUDA-only ones SKIP, a line per check on stdout and
    the summary; returns the rows by name. The suite's one whole dry run is the one from the
    offline bundle (tests/test_gpu_bundle.py), so the checks are not run twice."""
    assert report["mode"] == "dry-run"
    assert report["exit_status"] == 0
    rows = {row["name"]: row for row in report["checks"]}
    assert [row["name"] for row in report["checks"]] == CHECKS, stdout
    failed = {name: row["summary"] for name, row in rows.items() if row["status"] == "FAIL"}
    assert not failed, stdout
    for name in RUN_ON_CPU:
        assert rows[name]["status"] == "PASS", (name, rows[name])
        assert rows[name]["seconds"] > 0  # really run, in a process of its own
    for name in CUDA_ONLY:
        assert rows[name]["status"] == "SKIP", (name, rows[name])
        assert "no GPU" in rows[name]["summary"]
    # The tokens check compared two backends on the CPU and found them equal.
    assert rows["tokens"]["figures"]["prompts"] > 0
    assert rows["tokens"]["figures"]["differing_prompts"] == 0
    # One line per check on stdout, with its status, and the summary with the exit status.
    for name in CHECKS:
        line = re.search(rf"^(PASS|FAIL|SKIP)\s+{name}\s", stdout, re.MULTILINE)
        assert line, f"no line for {name}:\n{stdout}"
        assert line.group(1) == rows[name]["status"]
    assert "dry run" in stdout.splitlines()[0]
    assert re.search(r"^summary: \d+ PASS, 0 FAIL, \d+ SKIP .*exit status 0$", stdout, re.M)
    return rows


@pytest.mark.slow
def test_dry_run_with_this_environment_runs_the_ray_check(tmp_path: Path) -> None:
    """The dry run with this repository's environment (editable installs, Ray): the check the
    run from the offline bundle, which leaves Ray out, cannot run. That run (every check, by
    assert_full_dry_run) is tests/test_gpu_bundle.py's."""
    proc, report = _run(tmp_path, "--dry-run", "--only", "device_per_thread_ray")
    output = f"{proc.stdout}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, output
    assert report["mode"] == "dry-run"
    assert report["exit_status"] == 0
    assert report["complete"]
    environment = report["environment"]
    assert Path(environment["executor_core_path"]).is_relative_to(ROOT), environment
    [ray] = report["checks"]
    assert ray["name"] == "device_per_thread_ray"
    if environment["ray_installed"]:
        assert ray["status"] == "PASS", ray
        assert ray["seconds"] > 0  # really run, in a process of its own
    else:
        assert ray["status"] == "SKIP", ray
        assert "Ray" in ray["summary"], ray
    line = re.search(r"^(PASS|FAIL|SKIP)\s+device_per_thread_ray\s", proc.stdout, re.M)
    assert line, output
    assert line.group(1) == ray["status"]
    assert "dry run" in proc.stdout.splitlines()[0]
    assert re.search(r"^summary: \d+ PASS, 0 FAIL, \d+ SKIP .*exit status 0$", proc.stdout, re.M)


def test_a_check_past_its_time_limit_fails_the_run(tmp_path: Path) -> None:
    # A budget too short for anything: once the time kept for stopping a check is set aside,
    # the probe gets 1.5 s and is stopped at that limit (or, on a machine fast enough to
    # finish it, the check finds no time left). Either way the run must fail, and in time.
    began = time.monotonic()
    proc, report = _run(tmp_path, "--dry-run", "--only", "timing", "--budget", "21.5")
    assert time.monotonic() - began < 21.5 + 5  # the budget, and the interpreter's start
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert report["exit_status"] == 1
    statuses = [row["status"] for row in report["checks"]]
    assert "FAIL" in statuses, report
    assert "PASS" not in statuses, report
    assert re.search(r"^summary: .* exit status 1$", proc.stdout, re.MULTILINE), proc.stdout


def test_a_budget_that_leaves_no_time_runs_nothing(tmp_path: Path) -> None:
    proc, report = _run(tmp_path, "--dry-run", "--budget", "0.3")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    [probe] = [row for row in report["checks"] if row["name"] == "probe"]
    assert probe["status"] == "FAIL"
    assert "leaves no time" in probe["summary"]
    assert report["complete"]
