"""What runs inside a worker process, and what the driver hands it at start."""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import sys
import threading
from multiprocessing import reduction
from typing import Any

import attrs

from executor_channel import Kind, SegmentLayout, WorkerFds, WorkerRings, encode, serve_rings
from executor_core import WorkerDiedError
from executor_core.backend import RemoteFailure, WorkerWrapper

from ._probe import answer_probes

__all__ = [
    "PARENT_DIED_EXIT",
    "InheritedFd",
    "WorkerSpec",
    "dumps_with_fds",
    "loads_with_fds",
    "worker_died_error",
    "worker_main",
]

#: Exit status of a worker that left because its driver died.
PARENT_DIED_EXIT = 70
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


class InheritedFd:
    """A file descriptor handed to a worker process when it starts.

    With spawn and forkserver the descriptor is duplicated into the child by
    multiprocessing's own machinery (``reduction.DupFd``, valid only while a process is
    being started); with fork the child simply inherits it. Pickled by
    :func:`dumps_with_fds` (a hand-over to a running spare), it travels beside the bytes.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        passing: list[int] | None = getattr(_fds_in_transit, "fds", None)
        if passing is not None:
            passing.append(self.fd)
            return (_received_fd, (len(passing) - 1,))
        return (_rebuild_fd, (reduction.DupFd(self.fd),))


def _rebuild_fd(dup: Any) -> InheritedFd:
    return InheritedFd(dup.detach())


#: The descriptors of the object being pickled or unpickled by this thread (see below).
_fds_in_transit = threading.local()


def dumps_with_fds(obj: object) -> tuple[bytes, list[int]]:
    """Pickle ``obj`` for a process that is already running: each :class:`InheritedFd` in it
    becomes an index into the returned descriptors, which the caller sends beside the bytes
    (SCM_RIGHTS)."""
    fds: list[int] = []
    _fds_in_transit.fds = fds
    try:
        return pickle.dumps(obj, protocol=5), fds
    finally:
        _fds_in_transit.fds = None


def loads_with_fds(data: bytes, fds: list[int]) -> Any:
    """The receiving side of :func:`dumps_with_fds`: ``fds`` are the descriptors received."""
    _fds_in_transit.fds = fds
    try:
        return pickle.loads(data)
    finally:
        _fds_in_transit.fds = None


def _received_fd(index: int) -> InheritedFd:
    received: list[int] = _fds_in_transit.fds
    return InheritedFd(received[index])


@attrs.frozen(kw_only=True)
class WorkerSpec:
    """Everything one worker process needs, pickled to it at start."""

    #: The rank this process runs.
    rank: int
    #: The pickled :class:`WorkerWrapper` hosting the user's worker (from
    #: ``TransportHost.wrapper``; it carries no hooks: this process loads its own). Unpickled
    #: in the worker, so that whoever starts it (a node agent) never imports the user's code,
    #: and an import error there is reported like any start-up error. It applies the config's
    #: env again, after the start hook.
    wrapper: bytes
    #: Environment applied first thing in the process (config env + backend defaults).
    env: dict[str, str]
    segment: InheritedFd
    layout: SegmentLayout
    #: This worker's place among its node's workers: the reader it is on the call ring, and
    #: its reply ring (the rank itself on the driver's node).
    index: int
    #: Doorbells: this worker's call doorbell, the shared "a call slot is free" doorbell,
    #: the driver's reply doorbell, and this worker's "a reply slot is free" doorbell.
    call_bell: InheritedFd
    call_space_bell: InheritedFd
    reply_bell: InheritedFd
    reply_space_bell: InheritedFd
    death_pipe: InheritedFd
    #: PID of the driver, or None where the process's parent is not the driver (forkserver).
    parent_pid: int | None
    spin_s: float
    idle_spin_s: float
    #: This worker's end of its liveness probe (``_probe.Probes``).
    probe: InheritedFd | None = None
    #: Descriptors a forked child inherited and must close (the death pipe's write end, the
    #: starting side's probe ends).
    close_fds: tuple[int, ...] = ()


def set_parent_death_signal(parent_pid: int | None) -> None:
    """Ask Linux to SIGKILL this process when its parent dies; exit now if it already has."""
    if parent_pid is None:
        return
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the driver died before the request took effect
        os._exit(PARENT_DIED_EXIT)


def set_process_name(name: str) -> None:
    """Name the process for ps/top (Linux only; best effort)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def watch_death_pipe(fd: int) -> threading.Thread:
    """Exit the process when the driver's end of the death pipe closes (the driver is gone).

    A daemon thread blocked in ``read``: costs nothing while the driver lives, and works
    where PR_SET_PDEATHSIG does not (other OSes, a forkserver parent).
    """

    def run() -> None:
        while True:
            try:
                if not os.read(fd, 64):
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        os._exit(PARENT_DIED_EXIT)

    thread = threading.Thread(target=run, name="executor-mp-death-pipe", daemon=True)
    thread.start()
    return thread


def worker_main(spec: WorkerSpec) -> None:
    """Entry point of a worker process."""
    # Ctrl-C reaches the whole process group; the driver decides what happens to workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_parent_death_signal(spec.parent_pid)
    rank = spec.rank
    set_process_name(f"mp-worker-{rank}")
    for fd in spec.close_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    os.environ.update(spec.env)
    watch_death_pipe(spec.death_pipe.fd)
    if spec.probe is not None:
        answer_probes(spec.probe.fd)
    rings = WorkerRings.attach(
        WorkerFds(
            segment=spec.segment.fd,
            call_bell=spec.call_bell.fd,
            call_space_bell=spec.call_space_bell.fd,
            reply_bell=spec.reply_bell.fd,
            reply_space_bell=spec.reply_space_bell.fd,
        ),
        spec.layout,
        spec.index,
        spec.spin_s,
        spec.idle_spin_s,
    )
    calls, replies = rings.calls, rings.replies
    wrapper: WorkerWrapper | None = None
    try:
        wrapper = pickle.loads(spec.wrapper)
        assert isinstance(wrapper, WorkerWrapper)
        wrapper.init_worker()
    except Exception as exc:  # noqa: BLE001 - shipped to the driver with its traceback
        failure = RemoteFailure.capture(rank, "init_worker", exc)
        replies.write(*encode(Kind.READY, False, rank, 0, failure))
        if wrapper is not None:
            wrapper.shutdown()
        sys.exit(1)
    replies.write(*encode(Kind.READY, True, rank, 0, os.getpid()))
    try:
        serve_rings(wrapper.handle, calls, replies, rank)
    finally:
        wrapper.shutdown()


def worker_died_error(rank: int, exitcode: int, when: str) -> WorkerDiedError:
    """What a worker process's exit code (negative: the signal) says of its death."""
    detail = when
    if exitcode == PARENT_DIED_EXIT:
        detail = ", ".join(filter(None, [when, "it saw its driver die"]))
    if exitcode < 0:
        return WorkerDiedError(rank, signal=-exitcode, detail=detail)
    return WorkerDiedError(rank, exitcode=exitcode, detail=detail)
