"""Warm spares: worker processes started ahead of a death, so that a rank replacement skips
the process start and the imports.

With a recovery policy (``ExecutorConfig.recovery``), each node keeps
``MultiprocOptions.spare_workers`` idle processes, started once its ranks are ready. A spare
applies the node's environment (the one every rank of the node shares: the config's env, the
thread count), imports the worker class's module (torch with it, for a torch worker: most of a
new process's start), then sleeps in ``recv`` on a socket. It holds no rank, no ring and no
device. A rank replacement hands one the dead rank's :class:`WorkerSpec`, its descriptors
beside the bytes (SCM_RIGHTS), and it runs ``worker_main`` as a freshly started worker would;
a new spare is started in its place. A spare dies with the driver (the death pipe, and the
parent death signal) and at shutdown.

Not with ``start_method="fork"``: a forked worker starts from the driver's memory, imports
included, so a spare would save nothing.
"""

from __future__ import annotations

import contextlib
import multiprocessing.context
import os
import signal
import socket
import struct
from multiprocessing.process import BaseProcess

import attrs

from executor_core.backend import preload_worker

from ._process import (
    InheritedFd,
    WorkerSpec,
    dumps_with_fds,
    loads_with_fds,
    set_parent_death_signal,
    set_process_name,
    watch_death_pipe,
    worker_main,
)

__all__ = ["Spare", "SpareSpec", "spare_main", "worker_qualname"]

_HEADER = struct.Struct("!I")
#: More descriptors than a WorkerSpec carries.
_MAX_FDS = 32
#: Seconds a hand-over may wait for the spare to read it.
_HAND_OVER_S = 60.0


def worker_qualname(worker_cls: type | str) -> str:
    """``"module:Class"`` of ``worker_cls`` (a class, or such a qualname already)."""
    if isinstance(worker_cls, str):
        return worker_cls
    return f"{worker_cls.__module__}:{worker_cls.__qualname__}"


@attrs.frozen(kw_only=True)
class SpareSpec:
    """What a spare process is started with."""

    #: The node's environment, without the variables of a rank (applied at the hand-over).
    env: dict[str, str]
    #: What to import while idle: ``"module:Class"`` names (``preload_worker``).
    preload: tuple[str, ...]
    #: Its end of the socket on which it receives a rank.
    handover: InheritedFd
    death_pipe: InheritedFd
    #: PID of the driver, or None where the process's parent is not the driver (forkserver).
    parent_pid: int | None


class Spare:
    """One spare process, as the side that started it sees it."""

    def __init__(self, ctx: multiprocessing.context.BaseContext, spec: SpareSpec) -> None:
        self._ours, self._theirs = socket.socketpair()
        spec = attrs.evolve(spec, handover=InheritedFd(self._theirs.fileno()))
        self.process: BaseProcess = ctx.Process(  # type: ignore[attr-defined]  # every context has Process
            target=spare_main, args=(spec,), name="executor-mp-spare", daemon=True
        )
        #: Its process runs a rank now: the worker group's to stop, not this object's.
        self.handed_over = False
        self._stopped = False

    def start(self) -> None:
        """Start the process (from the thread that watches the workers: see ``_group``)."""
        try:
            self.process.start()
        finally:
            self._theirs.close()  # the child holds its copy, or there is no child

    @property
    def alive(self) -> bool:
        return self.process.pid is not None and self.process.exitcode is None

    def hand_over(self, spec: WorkerSpec) -> BaseProcess:
        """Give this spare ``spec``'s rank; it is that rank's worker process from now on."""
        data, fds = dumps_with_fds(spec)
        # Bounded: a spare reads once its imports are done; one that never does is stopped,
        # and the rank gets a new process.
        self._ours.settimeout(_HAND_OVER_S)
        with self._ours:
            socket.send_fds(self._ours, [_HEADER.pack(len(data))], fds)
            self._ours.sendall(data)
        self.handed_over = True
        return self.process

    def stop(self) -> None:
        """End an idle spare (its ``recv`` returns; SIGTERM if it is still importing)."""
        if self._stopped or self.handed_over:
            return
        self._stopped = True
        self._ours.close()
        process = self.process
        if process.pid is None:
            return
        if process.exitcode is None:
            process.terminate()
        process.join(5.0)
        if process.exitcode is None:
            process.kill()
            process.join(5.0)
        if process.exitcode is not None:
            process.close()


def spare_main(spec: SpareSpec) -> None:
    """Entry point of a spare process: warm up, wait for a rank, run it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver decides, as for a worker
    set_parent_death_signal(spec.parent_pid)
    set_process_name("mp-spare")
    os.environ.update(spec.env)
    watch_death_pipe(spec.death_pipe.fd)
    for name in spec.preload:
        # A module that fails to import here fails again when the rank's wrapper is
        # unpickled, and that error goes to the driver with its traceback.
        with contextlib.suppress(Exception):
            preload_worker(name)
    with socket.socket(fileno=spec.handover.fd) as sock:
        worker = _receive(sock)
    if worker is not None:  # None: the node is shutting down
        worker_main(worker)


def _receive(sock: socket.socket) -> WorkerSpec | None:
    head, fds, _flags, _address = socket.recv_fds(sock, _HEADER.size, _MAX_FDS)
    if not head:
        return None
    head += _read_exactly(sock, _HEADER.size - len(head))
    (size,) = _HEADER.unpack(head)
    # The socket pair was made by this process's parent, which alone holds the other end.
    spec = loads_with_fds(_read_exactly(sock, size), fds)
    if not isinstance(spec, WorkerSpec):
        raise TypeError(f"a spare was handed a {type(spec).__name__}, not a WorkerSpec")
    return spec


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    chunks = []
    while size:
        chunk = sock.recv(size)
        if not chunk:
            raise EOFError("the hand-over to a spare ended early")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)
