"""Process supervision for scripts/gpu_check.py: run one command with a time limit, stop it
with its whole process tree when it overruns, and stop what it left behind.

Linux only where it matters (``/proc``, ``prctl``); elsewhere the orphan handling does nothing
and a timed-out command is still stopped. Imported by gpu_check.py from its own directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["Finished", "become_subreaper", "clean_strays", "run_limited", "tail"]


@dataclasses.dataclass(frozen=True)
class Finished:
    """How a command run by :func:`run_limited` ended."""

    #: Its exit status (negative: the signal that ended it).
    returncode: int
    #: True when it overran its limit and was stopped.
    timed_out: bool
    #: Seconds from its start to its end, the stop included.
    seconds: float


def _children_of(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (Linux /proc; empty elsewhere)."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            fields = stat.rsplit(")", 1)[-1].split()
            if len(fields) > 1 and int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in _children_of(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    fields = stat.rsplit(")", 1)[-1].split()
    return bool(fields) and fields[0] == "Z"


def _kill(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _reap(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def _wait_for_any_exit(pids: Sequence[int], timeout_s: float) -> None:
    """Return when one of ``pids`` exits or after ``timeout_s``, without polling where the
    kernel has pidfds (Linux 5.3+); elsewhere after a short sleep."""
    pidfd_open = getattr(os, "pidfd_open", None)
    fds: list[int] = []
    if pidfd_open is not None:
        for pid in pids:
            with contextlib.suppress(OSError):  # gone already, or pidfds unsupported
                fds.append(pidfd_open(pid))
    try:
        if fds:
            select.select(fds, [], [], max(0.0, timeout_s))
        else:
            time.sleep(min(0.2, max(0.0, timeout_s)))
    finally:
        for fd in fds:
            os.close(fd)


def become_subreaper() -> bool:
    """Make this process inherit the orphans of its children's process trees (Linux), so
    that workers a command left behind can be found and stopped by :func:`clean_strays`."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_child_subreaper = 36
        return int(libc.prctl(pr_set_child_subreaper, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def clean_strays(grace_s: float) -> int:
    """Wait up to ``grace_s`` for processes that a finished command left behind (inherited
    as orphans, see :func:`become_subreaper`) to exit, then kill the rest. Returns how many
    had to be killed."""
    deadline = time.monotonic() + grace_s
    while True:
        _reap(_children_of(os.getpid()))  # collects the ones that have exited (zombies)
        alive = [pid for pid in _children_of(os.getpid()) if not _is_zombie(pid)]
        if not alive:
            return 0
        left = deadline - time.monotonic()
        if left <= 0:
            everything = alive + [d for pid in alive for d in _descendants(pid)]
            _kill(everything, signal.SIGKILL)
            _wait_for_any_exit(everything, 0.2)
            _reap(everything)
            return len(everything)
        _wait_for_any_exit(alive, left)


def run_limited(
    command: Sequence[str],
    *,
    log_path: Path,
    env: Mapping[str, str],
    limit_s: float,
    term_grace_s: float,
) -> Finished:
    """Run ``command`` in a session of its own, its output to ``log_path``, for at most
    ``limit_s`` seconds. One that overruns gets SIGTERM (so that it can shut its workers
    down), then, after ``term_grace_s``, its whole process tree is killed."""
    began = time.monotonic()
    timed_out = False
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True
        )
        try:
            process.wait(timeout=max(0.0, limit_s))
        except subprocess.TimeoutExpired:
            timed_out = True
            process.send_signal(signal.SIGTERM)  # the child unwinds, shutting executors down
            try:
                process.wait(timeout=term_grace_s)
            except subprocess.TimeoutExpired:
                tree = _descendants(process.pid)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
                _kill([process.pid, *tree], signal.SIGKILL)
                process.wait()
    return Finished(process.returncode, timed_out, time.monotonic() - began)


def tail(path: Path, lines: int = 25) -> list[str]:
    """The last ``lines`` lines of a text file (none when it cannot be read)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return text.splitlines()[-lines:]
