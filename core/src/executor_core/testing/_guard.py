"""What keeps the kit honest about time and leftovers: a time limit that turns a hang into a
failure naming the rule; which processes are an executor's workers on this machine; and what
the driver and those workers hold (threads, descriptors, /dev/shm, temporary files), so that
only what the executor under test made must be gone after it."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing.util
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import FrameType

import attrs

__all__ = [
    "ConformanceTimeout",
    "Footprint",
    "pids_alive",
    "private_tempdir",
    "process_identity",
    "resources",
    "running",
    "shm_held",
    "temp_leftovers",
    "time_limit",
    "wait_until",
]

SHM = "/dev/shm/"


class ConformanceTimeout(AssertionError):
    """A kit step ran past its time limit: something in the backend hangs."""


@contextlib.contextmanager
def time_limit(seconds: float, what: str) -> Iterator[None]:
    """Fail with :class:`ConformanceTimeout` if the block runs past ``seconds`` (SIGALRM, in
    the main thread only; a timer already set, pytest-timeout's, is put back afterwards)."""
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


def process_identity(pid: int | str = "self") -> str:
    """The machine (boot id), pid namespace and start time of process ``pid`` as this process
    sees it ("" where /proc cannot tell): a pid a worker reports is a process the kit may
    kill, stop and inspect only where the worker's own identity is the same."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink(f"/proc/{pid}/ns/pid")
        started = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""
    return f"{boot} {namespace} {started}"


def _fds(pid: int | str = "self") -> dict[str, str]:
    """Process ``pid``'s open descriptors and what each points at ({} where /proc cannot
    tell: not Linux, or not ours to read)."""
    found = {}
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                found[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
    return found


def _shm_maps(pid: int | str = "self") -> dict[str, str]:
    """The /dev/shm files process ``pid`` maps: inode -> path (``(deleted)`` once unlinked)."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return {}
    fields = (line.split(maxsplit=5) for line in lines)
    return {f[4]: f[5] for f in fields if len(f) == 6 and f[5].startswith(SHM)}


def shm_held(pids: Iterable[int]) -> set[str]:
    """The /dev/shm names (not yet unlinked) that processes ``pids`` hold open or mapped."""
    names: set[str] = set()
    for pid in pids:
        for path in (*_fds(pid).values(), *_shm_maps(pid).values()):
            if path.startswith(SHM) and not path.endswith(" (deleted)"):
                names.add(path)
    return names


def _shm_names() -> frozenset[str]:
    with contextlib.suppress(OSError):
        return frozenset(SHM + name for name in os.listdir(SHM))
    return frozenset()


@attrs.define
class Footprint:
    """The driver's threads, descriptors and /dev/shm mappings at one moment, and the /dev/shm
    names that the driver and an executor's worker processes were seen to hold since (and
    did not exist then): what the executor made, which must be gone after it."""

    threads: frozenset[int]
    fds: frozenset[str]
    maps: frozenset[str]
    shm: frozenset[str]
    held: set[str] = attrs.field(factory=set)

    @classmethod
    def take(cls) -> Footprint:
        """The state now."""
        idents = frozenset(t.ident for t in threading.enumerate() if t.ident is not None)
        return cls(idents, frozenset(_fds()), frozenset(_shm_maps()), _shm_names())

    def note(self, pids: Iterable[int]) -> None:
        """Record the /dev/shm names the driver and worker processes ``pids`` hold now."""
        self.held |= shm_held([os.getpid(), *pids]) - self.shm

    def leftovers(self, session_threads: Iterable[str] = (), check_fds: bool = True) -> list[str]:
        """What the executor made that is still here (threads named ``session_threads*`` are
        the backend's session's and allowed; ``check_fds=False``: descriptors are not checked)."""
        prefixes = tuple(session_threads)
        found = [
            f"thread {t.name!r}"
            for t in threading.enumerate()
            if t.ident not in self.threads and t.is_alive() and not t.name.startswith(prefixes)
        ]
        if check_fds:
            found += [
                f"fd {fd} -> {target}"
                for fd, target in sorted(_fds().items())
                if fd not in self.fds and "/proc/" not in target  # the listing's own fd
            ]
        maps = _shm_maps()
        found += [f"a mapping of {maps[inode]}" for inode in sorted(set(maps) - self.maps)]
        return found + sorted(name for name in self.held if os.path.exists(name))

    def wait_clean(
        self, within_s: float, session_threads: Iterable[str] = (), check_fds: bool = True
    ) -> list[str]:
        """:meth:`leftovers`, polled until none are left or ``within_s`` passed."""
        deadline = time.monotonic() + within_s
        while (left := self.leftovers(session_threads, check_fds)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left


def resources() -> dict[str, int]:
    """Counts of what the driver holds: threads, descriptors, /dev/shm mappings, live objects
    of the SDK's and its backends' classes (``executor_*`` modules), and RSS bytes."""
    gc.collect()
    objects = sum(
        1 for o in gc.get_objects() if getattr(type(o), "__module__", "").startswith("executor_")
    )
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError:  # not Linux: descriptors, mappings and RSS read as 0
        pages = 0
    return {
        "threads": threading.active_count(),
        "fds": len(_fds()),
        "shm mappings": len(_shm_maps()),
        "objects": objects,
        "rss": pages * os.sysconf("SC_PAGE_SIZE"),
    }


def wait_until(condition: Callable[[], object], within_s: float, every_s: float = 0.01) -> bool:
    """Whether ``condition()`` came true within ``within_s`` (polled every ``every_s``)."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(every_s)
    return True


def pids_alive(pids: Iterable[int], within_s: float) -> list[int]:
    """The processes among ``pids`` still running after up to ``within_s`` (zombies count as
    ended: they run no code)."""
    pids, deadline = list(pids), time.monotonic() + within_s
    while (alive := [p for p in pids if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not: it runs no code)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True


@contextlib.contextmanager
def private_tempdir() -> Iterator[Path]:
    """Point ``tempfile.gettempdir()`` at a fresh, empty directory for the block, in this
    process (``tempfile.tempdir``) and in those it starts (``TMPDIR``), so that what a backend
    leaves there is told from what other programs leave; removed afterwards. This process's
    ``multiprocessing`` directory (kept until it exits) is made first, in the real one."""
    multiprocessing.util.get_temp_dir()
    saved_dir, saved_env = tempfile.tempdir, os.environ.get("TMPDIR")
    path = Path(tempfile.mkdtemp(prefix="executor-kit-tmp-"))
    tempfile.tempdir = os.environ["TMPDIR"] = str(path)
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
    """The entries of ``path`` (but those named ``allowed*``) still there after ``within_s``."""
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
