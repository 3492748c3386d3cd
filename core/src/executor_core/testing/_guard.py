"""Time and leftovers: a time limit that fails a hang naming the rule; which processes are an
executor's workers; what the driver and they hold (Linux's /proc), to check that what the
executor made, and only that, is gone after it."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing.util
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import FrameType
from unittest import mock

import attrs

SHM = "/dev/shm/"


class ConformanceTimeout(AssertionError):
    """A kit step ran past its time limit: something in the backend hangs."""


@contextlib.contextmanager
def time_limit(seconds: float, what: str) -> Iterator[None]:
    """Fail with :class:`ConformanceTimeout` if the block runs past ``seconds`` (SIGALRM, in
    the main thread; a timer already set is put back after)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(_signum: int, _frame: FrameType | None) -> None:
        raise ConformanceTimeout(
            f"rule broken: {what} did not finish within {seconds:g} s; a start-up, call or "
            "shutdown hangs (every blocking wait needs a timeout or a failure path)"
        )

    previous = signal.signal(signal.SIGALRM, on_alarm)
    outer_s, started = signal.setitimer(signal.ITIMER_REAL, seconds)[0], time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_s:
            left = outer_s - (time.monotonic() - started)
            signal.setitimer(signal.ITIMER_REAL, max(left, 0.001))


def wait_until(condition: Callable[[], object], within_s: float, every_s: float = 0.01) -> bool:
    """Whether ``condition()`` came true within ``within_s`` (polled every ``every_s``)."""
    deadline = time.monotonic() + within_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(every_s)
    return bool(condition())


def _read(path: str | Path) -> str:
    """A file's text ("" where it cannot be read: gone, not ours, or not Linux)."""
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _listdir(path: str | Path) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _stat(pid: int | str) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name: state first ([] if gone)."""
    return _read(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()


def process_identity(pid: int | str = "self") -> str:
    """Process ``pid``'s machine (boot id), pid namespace and start time ("" where unknown):
    a pid a worker reports is that process only where its own identity is the same."""
    try:
        namespace, started = os.readlink(f"/proc/{pid}/ns/pid"), _stat(pid)[19]
    except (OSError, IndexError):
        return ""
    return f"{_read('/proc/sys/kernel/random/boot_id').strip()} {namespace} {started}"


def freeze(pid: int, within_s: float = 5.0) -> None:
    """SIGSTOP ``pid`` and return once it is stopped (the signal lands asynchronously)."""
    os.kill(pid, signal.SIGSTOP)
    stopped = wait_until(lambda: _stat(pid)[:1] in (["T"], ["t"]), within_s, 0.001)
    assert stopped, f"process {pid} not stopped {within_s:g} s after SIGSTOP"


def ended(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie has: it runs no code)."""
    return _stat(pid)[:1] in ([], ["Z"], ["X"])


def pids_alive(pids: Iterable[int], within_s: float) -> list[int]:
    """Those of ``pids`` still running after up to ``within_s``."""
    pids = list(pids)
    wait_until(lambda: all(ended(pid) for pid in pids), within_s, 0.05)
    return [pid for pid in pids if not ended(pid)]


def _fds(pid: int | str = "self") -> dict[str, str]:
    """Process ``pid``'s open descriptors and what each points at."""
    found = {}
    for fd in _listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            found[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
    return found


def _shm_maps(pid: int | str = "self") -> dict[str, str]:
    """The /dev/shm files process ``pid`` maps: inode -> path (``(deleted)`` once unlinked)."""
    fields = (line.split(maxsplit=5) for line in _read(f"/proc/{pid}/maps").splitlines())
    return {f[4]: f[5] for f in fields if len(f) == 6 and f[5].startswith(SHM)}


def shm_held(pids: Iterable[int]) -> set[str]:
    """The /dev/shm names (not unlinked) that processes ``pids`` hold open or mapped."""
    paths = {p for pid in pids for p in (*_fds(pid).values(), *_shm_maps(pid).values())}
    return {p for p in paths if p.startswith(SHM) and not p.endswith(" (deleted)")}


@attrs.define
class Footprint:
    """The driver's threads, descriptors and /dev/shm mappings now, and the /dev/shm names
    (new since) that it and an executor's worker processes were seen to hold: what must be
    gone after the executor (but threads named ``session_threads*``)."""

    session_threads: tuple[str, ...]
    check_fds: bool
    threads: frozenset[int | None] = attrs.field(
        factory=lambda: frozenset(t.ident for t in threading.enumerate())
    )
    fds: frozenset[str] = attrs.field(factory=lambda: frozenset(_fds()))
    maps: frozenset[str] = attrs.field(factory=lambda: frozenset(_shm_maps()))
    shm: frozenset[str] = attrs.field(factory=lambda: frozenset(SHM + n for n in _listdir(SHM)))
    held: set[str] = attrs.field(factory=set)

    def note(self, pids: Iterable[int | None]) -> None:
        """Record the /dev/shm names the driver and worker processes ``pids`` hold now."""
        self.held |= shm_held([os.getpid(), *(p for p in pids if p)]) - self.shm

    def leftovers(self, within_s: float) -> list[str]:
        """What the executor made that is still here after up to ``within_s``."""

        def left() -> list[str]:
            found = [
                f"thread {t.name!r}"
                for t in threading.enumerate()
                if t.ident not in self.threads and not t.name.startswith(self.session_threads)
            ]
            fds = _fds() if self.check_fds else {}
            new = {fd: to for fd, to in fds.items() if fd not in self.fds and "/proc/" not in to}
            found += [f"fd {fd} -> {to}" for fd, to in new.items()]
            maps = _shm_maps()
            found += [f"a mapping of {maps[inode]}" for inode in set(maps) - self.maps]
            return found + [name for name in self.held if os.path.exists(name)]

        wait_until(lambda: not left(), within_s, 0.05)
        return sorted(left())


def resources() -> dict[str, int]:
    """The driver's threads, descriptors, /dev/shm mappings, RSS, and objects of ``executor_*``
    classes (but errors, which a log handler, pytest's say, may keep)."""
    gc.collect()
    kept = [str(t.__module__) for t in map(type, gc.get_objects()) if not issubclass(t, Exception)]
    pages = int((_read("/proc/self/statm").split() or ["0", "0"])[1])
    return {
        "threads": threading.active_count(),
        "fds": len(_fds()),
        "shm mappings": len(_shm_maps()),
        "objects": sum(1 for module in kept if module.startswith("executor_")),
        "rss": pages * os.sysconf("SC_PAGE_SIZE"),
    }


@contextlib.contextmanager
def private_tempdir() -> Iterator[Path]:
    """Point ``tempfile.gettempdir()`` (and ``TMPDIR``) at a fresh, empty directory for the
    block, so that what a backend leaves there is told from what other programs leave."""
    multiprocessing.util.get_temp_dir()  # this process's own, made in the real one
    with (
        tempfile.TemporaryDirectory(prefix="executor-kit-tmp-", ignore_cleanup_errors=True) as tmp,
        mock.patch.dict(os.environ, TMPDIR=tmp),
        mock.patch.object(tempfile, "tempdir", tmp),
    ):
        yield Path(tmp)


def temp_leftovers(path: Path, within_s: float, allowed: Iterable[str] = ()) -> list[str]:
    """The entries of ``path`` (but those named ``allowed*``) still there after ``within_s``."""

    def left() -> list[str]:
        return sorted(name for name in _listdir(path) if not name.startswith(tuple(allowed)))

    wait_until(lambda: not left(), within_s, 0.05)
    return left()
