"""A watchdog process that removes what a local Ray instance left behind.

Ray fate-shares most of its processes with the driver that started it, but not all: after
the driver is killed, its dashboard and runtime-env agents can linger as orphans. The backend
starts this small process next to each local instance with the instance's process ids on the
command line and a pipe on stdin; once a second it adds the processes those started since
(the workers a raylet starts, which a raylet's death orphans). When stdin reaches end of file
(the driver shut Ray down, or died), it waits a moment for the processes to exit by
themselves, kills the survivors and
removes the instance's temp directory and the POSIX semaphores that Ray's object stores
(raylets) leave in /dev/shm when killed (``sem.hdr<pid>-*``, ``sem.obj<pid>-*``, created for
compiled-graph channels). It imports only psutil, so it starts fast.

Usage: ``python -m executor_plugin_ray._reaper <json>`` with
``{"pids": [[pid, create_time], ...], "temp_dir": str | null, "grace_s": float}``.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import sys
from collections.abc import Iterable

import psutil  # type: ignore[import-untyped]  # psutil ships no type information

__all__ = ["main", "reap", "remove_orphan_semaphores"]

_SHM_DIR = "/dev/shm"


def reap(pids: list[tuple[int, float]], temp_dir: str | None, grace_s: float) -> list[int]:
    """Kill those of ``pids`` still running after ``grace_s`` s; remove ``temp_dir``.

    A pid is only touched if its process still has the recorded creation time, so a reused
    pid is never killed. Returns the pids that had to be killed.
    """
    procs: list[psutil.Process] = []
    for pid, created in pids:
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - created) < 0.01:
                procs.append(proc)
        except psutil.Error:
            continue
    _gone, alive = psutil.wait_procs(procs, timeout=grace_s)
    killed = []
    for proc in alive:
        try:
            proc.kill()
            killed.append(proc.pid)
        except psutil.Error:
            continue
    psutil.wait_procs(alive, timeout=grace_s)
    remove_orphan_semaphores(pid for pid, _created in pids)
    if temp_dir is not None:
        shutil.rmtree(temp_dir, ignore_errors=True)
    return killed


def remove_orphan_semaphores(
    pids: Iterable[int], shm_dir: str = _SHM_DIR, wait_s: float = 0.0
) -> list[str]:
    """Unlink the ``sem.hdr<pid>-*`` / ``sem.obj<pid>-*`` semaphores of ``pids`` that are gone.

    Ray's object store names the semaphores of its mutable objects after its own pid and
    unlinks them on a clean exit only. Waits up to ``wait_s`` s for the processes to end;
    semaphores of a pid that is still running are kept. Returns the names removed.
    """
    pids = list(pids)
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            continue
    if procs and wait_s > 0:
        psutil.wait_procs(procs, timeout=wait_s)
    dead = {pid for pid in pids if not psutil.pid_exists(pid)}
    if not dead:
        return []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    removed = []
    for name in names:
        for prefix in ("sem.hdr", "sem.obj"):
            owner, sep, _rest = name.removeprefix(prefix).partition("-")
            if name.startswith(prefix) and sep and owner.isdigit() and int(owner) in dead:
                try:
                    os.unlink(os.path.join(shm_dir, name))
                    removed.append(name)
                except FileNotFoundError:
                    pass
    return removed


def _with_descendants(pids: set[tuple[int, float]]) -> set[tuple[int, float]]:
    """``pids`` and the processes they started since (a raylet starts its workers later)."""
    found = set(pids)
    for pid, created in pids:
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - created) >= 0.01:
                continue
            found.update((child.pid, child.create_time()) for child in proc.children(True))
        except psutil.Error:
            continue
    return found


def main(argv: list[str]) -> int:
    """Until stdin closes, look once a second for the processes Ray's started since (a worker
    orphaned by a raylet that died must still be reaped); then :func:`reap`."""
    spec = json.loads(argv[1])
    pids = {(int(pid), float(created)) for pid, created in spec["pids"]}
    stdin = sys.stdin.fileno()
    while True:  # at EOF, the driver closed the pipe or died
        if select.select([stdin], [], [], 1.0)[0] and not os.read(stdin, 4096):
            break
        pids = _with_descendants(pids)
    reap(sorted(pids), spec["temp_dir"], float(spec["grace_s"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
