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
