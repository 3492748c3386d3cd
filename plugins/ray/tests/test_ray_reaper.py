"""The reaper's semaphore clean-up touches only the semaphores of processes that are gone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from executor_plugin_ray._reaper import remove_orphan_semaphores


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid


def test_removes_only_dead_owners_semaphores(tmp_path: Path) -> None:
    dead, alive = _dead_pid(), os.getpid()
    names = [
        f"sem.hdr{dead}-123",
        f"sem.obj{dead}-123",
        f"sem.hdr{alive}-456",
        f"sem.obj{alive}-456",
        f"sem.other{dead}-1",
        f"sem.hdr{dead}x-1",
        "psm_unrelated",
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    removed = remove_orphan_semaphores([dead, alive], shm_dir=str(tmp_path))
    assert sorted(removed) == [f"sem.hdr{dead}-123", f"sem.obj{dead}-123"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])


def test_reaps_what_its_processes_started_after_it_and_that_was_orphaned() -> None:
    """A raylet starts its workers after the reaper has taken the instance's pids, and its
    death orphans them: the reaper, looking once a second, still ends them at EOF."""
    import json
    import time

    import psutil  # type: ignore[import-untyped]  # psutil ships no type information

    # A "raylet" that starts a "worker" a moment later, then dies (the worker is orphaned).
    raylet = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; time.sleep(1.5); "
            "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            "print(w.pid, flush=True); time.sleep(1.5)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    spec = {"pids": [[raylet.pid, psutil.Process(raylet.pid).create_time()]], "temp_dir": None}
    reaper = subprocess.Popen(
        [sys.executable, "-m", "executor_plugin_ray._reaper", json.dumps({**spec, "grace_s": 0.5})],
        stdin=subprocess.PIPE,
    )
    assert raylet.stdout is not None
    worker = int(raylet.stdout.readline())
    raylet.stdout.close()
    raylet.wait(10)  # the worker is an orphan now
    time.sleep(0.5)
    assert psutil.pid_exists(worker)
    assert reaper.stdin is not None
    reaper.stdin.close()
    assert reaper.wait(15) == 0
    deadline = time.monotonic() + 5
    while psutil.pid_exists(worker) and psutil.Process(worker).status() != "zombie":
        assert time.monotonic() < deadline, "the orphaned worker still runs"
        time.sleep(0.05)
