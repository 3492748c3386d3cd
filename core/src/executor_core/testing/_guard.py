"""What keeps the conformance kit honest about time and leftovers: a time limit that turns a
hang into a failure naming the rule, and snapshots of threads, descriptors and shared memory.
"""

from __future__ import annotations

import contextlib
import multiprocessing.util
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import FrameType

import attrs

__all__ = [
    "ConformanceTimeout",
    "Snapshot",
    "grown",
    "pids_alive",
    "private_tempdir",
    "resources",
    "temp_leftovers",
    "time_limit",
]


class ConformanceTimeout(AssertionError):
    """A kit step ran past its time limit: something in the backend hangs."""


@contextlib.contextmanager
def time_limit(seconds: float, what: str) -> Iterator[None]:
    """Fail with :class:`ConformanceTimeout` if the block runs past ``seconds``.

    Uses SIGALRM in the main thread (where pytest runs tests); elsewhere, or without
    ``setitimer``, the block runs unguarded. A timer already set (pytest-timeout's) is put
    back afterwards, less the time spent here.
    """
    if threading.current_thread() is not threading.main_thread() or not hasattr(
        signal, "setitimer"
    ):
        yield
        return

    def on_alarm(_signum: int, _frame: FrameType | None) -> None:
        raise ConformanceTimeout(
            f"rule broken: {what} did not finish within {seconds:g} s; a start-up, call or "
            "shutdown hangs (every blocking wait needs a timeout or a failure path)"
        )

    previous = signal.signal(signal.SIGALRM, on_alarm)
    outer_s, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    started = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_s:
            left = outer_s - (time.monotonic() - started)
            signal.setitimer(signal.ITIMER_REAL, max(left, 0.001))


def _fds() -> set[str]:
    try:
        return set(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux: descriptors are not checked
        return set()


def _fd_target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


def _shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


@attrs.frozen
class Snapshot:
    """Threads, file descriptors and /dev/shm entries of this process at one moment."""

    threads: frozenset[int]
    fds: frozenset[str]
    shm: frozenset[str]

    @classmethod
    def take(cls) -> Snapshot:
        """The state now."""
        return cls(
            frozenset(t.ident for t in threading.enumerate() if t.ident is not None),
            frozenset(_fds()),
            frozenset(_shm()),
        )

    def leftovers(
        self, *, session_threads: Iterable[str] = (), check_fds: bool = True
    ) -> list[str]:
        """What exists now and did not at the snapshot (threads whose name starts with one
        of ``session_threads`` are the backend's session, not the executor's, and allowed)."""
        prefixes = tuple(session_threads)
        found = [
            f"thread {t.name!r}"
            for t in threading.enumerate()
            if t.ident not in self.threads and t.is_alive() and not t.name.startswith(prefixes)
        ]
        if check_fds:
            found += [f"fd {fd} -> {_fd_target(fd)}" for fd in sorted(_fds() - self.fds)]
            found = [f for f in found if "/proc/" not in f]  # the listing's own descriptor
        found += [f"/dev/shm/{name}" for name in sorted(_shm() - self.shm)]
        return found

    def wait_clean(
        self, within_s: float, *, session_threads: Iterable[str] = (), check_fds: bool = True
    ) -> list[str]:
        """:meth:`leftovers`, polled until none are left or ``within_s`` passed."""
        deadline = time.monotonic() + within_s
        while True:
            left = self.leftovers(session_threads=session_threads, check_fds=check_fds)
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.05)


def pids_alive(pids: Iterable[int], within_s: float) -> list[int]:
    """The processes among ``pids`` still running after up to ``within_s`` (zombies count as
    ended: they run no code)."""
    deadline = time.monotonic() + within_s
    while True:
        alive = [pid for pid in pids if _running(pid)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "\nState:\tZ" not in status


@contextlib.contextmanager
def private_tempdir() -> Iterator[Path]:
    """Point ``tempfile.gettempdir()`` at a fresh, empty directory for the block, in this
    process (``tempfile.tempdir``) and in the processes it starts (``TMPDIR``), so that what
    a backend leaves in the temporary directory can be told from what other programs put
    there. Removed afterwards, with whatever is left in it.

    This process's ``multiprocessing`` directory (``pymp-*``, kept until the process exits)
    is made first, in the real temporary directory, so that it never lands here.
    """
    multiprocessing.util.get_temp_dir()
    saved_dir, saved_env = tempfile.tempdir, os.environ.get("TMPDIR")
    path = Path(tempfile.mkdtemp(prefix="executor-kit-tmp-"))
    tempfile.tempdir = str(path)
    os.environ["TMPDIR"] = str(path)
    try:
        yield path
    finally:
        tempfile.tempdir = saved_dir
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env
        shutil.rmtree(path, ignore_errors=True)


def temp_leftovers(path: Path, within_s: float, allowed: Iterable[str] = ()) -> list[str]:
    """The entries of ``path`` (but those whose name starts with one of ``allowed``) still
    there after up to ``within_s``."""
    prefixes = tuple(allowed)
    deadline = time.monotonic() + within_s
    while True:
        try:
            left = sorted(p.name for p in path.iterdir() if not p.name.startswith(prefixes))
        except OSError:
            left = []
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


#: RSS a run of recoveries may add to the driver (allocator noise, not a leak).
_RSS_SLACK = 32 << 20


def resources() -> dict[str, int]:
    """The driver's thread count, descriptor count, /dev/shm entries and RSS now."""
    try:
        fds = len(os.listdir("/proc/self/fd"))
        rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: only threads are checked
        fds = rss = 0
    try:
        shm = len(os.listdir("/dev/shm"))
    except OSError:
        shm = 0
    return {"threads": threading.active_count(), "fds": fds, "shm": shm, "rss": rss}


def grown(before: dict[str, int], now: dict[str, int], *, check_fds: bool) -> dict[str, str]:
    limits = {"threads": 0, "fds": 0 if check_fds else None, "shm": 0, "rss": _RSS_SLACK}
    return {
        key: f"{before[key]} -> {now[key]}"
        for key, slack in limits.items()
        if slack is not None and now[key] > before[key] + slack
    }
