"""One node's worker processes (the driver's for its machine, a node agent's for its own):
what runs in each, the warm spares, the liveness probes, and the group that starts, watches,
replaces and stops them.

A warm spare (with a recovery policy; not with "fork", where a worker starts from the
driver's memory anyway) applies the node's environment, imports the worker class's module
(torch with it: most of a new process's start), then sleeps in ``recv`` until a rank
replacement hands it a :class:`WorkerSpec`, its descriptors beside the bytes (SCM_RIGHTS).
A liveness probe is a byte each worker echoes from a thread of its own: a worker busy in a
long call answers; a stopped one, or one frozen holding the interpreter's lock, does not.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from multiprocessing import reduction
from multiprocessing.connection import wait as wait_for_ready
from multiprocessing.process import BaseProcess
from typing import Any

import attrs

from executor_channel import (
    IdleTrim,
    Kind,
    NodeRings,
    SegmentLayout,
    WorkerFds,
    WorkerRings,
    encode,
    serve_rings,
)
from executor_core import ConfigError, WorkerDiedError
from executor_core.backend import RemoteFailure, WorkerWrapper, preload_worker

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._executor import MultiprocOptions

__all__ = ["NodeSpec", "WorkerGroup", "WorkerLaunch", "check_devices", "worker_died_error"]

logger = logging.getLogger("executor_plugin_multiproc")

#: Exit status of a worker that left because its driver died.
PARENT_DIED_EXIT = 70
_HEADER = struct.Struct("!I")


@attrs.frozen
class WorkerLaunch:
    """What one worker process is started with: its place in the job, its wrapper, pickled
    (portable: it loads its own hooks), and the config's environment."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    wrapper: bytes
    config_env: dict[str, str]

    @classmethod
    def of(cls, wrapper: WorkerWrapper, config_env: dict[str, str]) -> WorkerLaunch:
        c = wrapper.context
        data = pickle.dumps(wrapper.portable(), protocol=5)
        return cls(c.rank, c.local_rank, c.world_size, c.local_world_size, data, dict(config_env))

    def env(self, *, rank: bool = True) -> dict[str, str]:
        """The torchrun-style variables (without the rank's for a spare), an OpenMP thread
        count that shares this machine's cores between its workers, the config's env over
        both."""
        env = {"WORLD_SIZE": str(self.world_size), "LOCAL_WORLD_SIZE": str(self.local_world_size)}
        if rank:
            env.update(RANK=str(self.rank), LOCAL_RANK=str(self.local_rank))
        if "OMP_NUM_THREADS" not in self.config_env and "OMP_NUM_THREADS" not in os.environ:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
            per_worker = (cores or os.cpu_count() or 1) // max(1, self.local_world_size)
            env["OMP_NUM_THREADS"] = str(max(1, per_worker))
        return env | self.config_env


@attrs.frozen
class NodeSpec:
    """What a node agent needs to start its node's workers, sent once it has joined."""

    node_rank: int
    #: The name the driver gives this node (``WorkerContext.node_id`` of its ranks).
    node_id: str
    launches: tuple[WorkerLaunch, ...]
    options: MultiprocOptions
    #: The config's device type: the agent checks there is a GPU for each worker.
    device: str
    #: The driver's ``TransportHost.worker_env`` (forwarded NCCL and gloo variables).
    worker_env: dict[str, str]
    #: Warm spares the node keeps, and the ``"module:Class"`` they import.
    spares: int
    preload: str


class InheritedFd:
    """A descriptor handed to a process at its start: duplicated into it by multiprocessing
    (spawn, forkserver), or inherited (fork)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return (_rebuild_fd, (reduction.DupFd(self.fd),))


def _rebuild_fd(dup: Any) -> InheritedFd:
    return InheritedFd(dup.detach())


@attrs.frozen(kw_only=True)
class WorkerSpec:
    """Everything one worker process needs, pickled to it at start (or to a spare)."""

    #: Its wrapper is unpickled in the worker: whoever starts it never imports the user's
    #: code, and an import error is reported like any start-up error.
    launch: WorkerLaunch
    layout: SegmentLayout
    #: Its place among its node's workers: its reader on the call ring, its reply ring.
    index: int
    #: The death pipe, its probe's end, then its rings' (``WorkerFds``, in order).
    fds: tuple[InheritedFd, ...]
    #: PID of the driver, or None where the parent is not the driver (forkserver).
    parent_pid: int | None
    options: MultiprocOptions
    #: What a forked child inherited and must close (the death pipe's write end, the
    #: starting side's probe ends).
    close_fds: tuple[int, ...] = ()


def _enter(name: str, parent_pid: int | None, env: dict[str, str], death_fd: int) -> None:
    """First thing in a worker or spare: leave Ctrl-C and its fate to the driver, die with
    it (the parent death signal, and the death pipe for a forkserver parent or another OS)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME, for ps and top
        if parent_pid is not None:
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if parent_pid is not None and os.getppid() != parent_pid:  # it died already
        os._exit(PARENT_DIED_EXIT)
    os.environ.update(env)

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(death_fd, 64):
                pass
        os._exit(PARENT_DIED_EXIT)

    threading.Thread(target=watch, name="executor-mp-death-pipe", daemon=True).start()


def worker_main(spec: WorkerSpec) -> None:
    """Entry point of a worker process."""
    for fd in spec.close_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    death, probe, *fds = (fd.fd for fd in spec.fds)
    rank, options = spec.launch.rank, spec.options
    _enter(f"mp-worker-{rank}", spec.parent_pid, spec.launch.env(), death)
    _answer_probes(probe)
    ring_fds = WorkerFds(**dict(zip(attrs.fields_dict(WorkerFds), fds, strict=True)))
    rings = WorkerRings.attach(
        ring_fds, spec.layout, spec.index, options.spin_s, options.idle_spin_s
    )
    wrapper: WorkerWrapper | None = None
    try:
        wrapper = pickle.loads(spec.launch.wrapper)
        assert isinstance(wrapper, WorkerWrapper)
        wrapper.init_worker()
    except Exception as exc:  # noqa: BLE001 - shipped to the driver with its traceback
        failure = RemoteFailure.capture(rank, "init_worker", exc)
        rings.replies.write(*encode(Kind.READY, False, rank, 0, failure))
        if wrapper is not None:
            wrapper.shutdown()
        sys.exit(1)
    rings.replies.write(*encode(Kind.READY, True, rank, 0, os.getpid()))
    try:
        serve_rings(wrapper.handle, rings.calls, rings.replies, rank)
    finally:
        wrapper.shutdown()


def _spare_main(
    env: dict[str, str], preload: str, handover: InheritedFd, death: InheritedFd, parent: int | None
) -> None:
    """Entry point of a spare process: warm up, wait for a rank, run it."""
    _enter("mp-spare", parent, env, death.fd)
    # A module that fails here fails again when the rank's wrapper is unpickled, and that
    # error goes to the driver with its traceback.
    with contextlib.suppress(Exception):
        preload_worker(preload)
    with socket.socket(fileno=handover.fd) as sock:
        head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 16)
        if not head:
            return  # the node is shutting down
        (size,) = _HEADER.unpack(head)
        data = sock.recv(size, socket.MSG_WAITALL)
    if len(data) != size:
        raise EOFError("the hand-over to a spare ended early")
    # The socket pair was made by this process's parent, which alone holds the other end.
    spec: WorkerSpec = pickle.loads(data)
    worker_main(attrs.evolve(spec, fds=tuple(map(InheritedFd, fds))))


def worker_died_error(rank: int, exitcode: int, when: str) -> WorkerDiedError:
    """What a worker process's exit code (negative: the signal) says of its death."""
    if exitcode == PARENT_DIED_EXIT:
        when = ", ".join(filter(None, [when, "it saw its driver die"]))
    if exitcode < 0:
        return WorkerDiedError(rank, signal=-exitcode, detail=when)
    return WorkerDiedError(rank, exitcode=exitcode, detail=when)


def check_devices(
    options: MultiprocOptions, device: str, workers: int, env: dict[str, str]
) -> None:
    """Refuse, before any worker starts, what would fail in the workers: fork once CUDA is
    initialised here (a forked child cannot use CUDA), or fewer GPUs than workers."""
    torch = sys.modules.get("torch")
    if options.start_method == "fork" and torch is not None and torch.cuda.is_initialized():
        raise ConfigError(
            "backend_options",
            {"start_method": "fork"},
            "CUDA is already initialised in this process, and a forked worker cannot use it "
            "('Cannot re-initialize CUDA in forked subprocess'); use start_method='spawn' "
            "(the default) or 'forkserver'",
        )
    if device == "cuda":
        from executor_core.torch import check_gpu_per_local_rank  # imports torch: cuda only

        check_gpu_per_local_rank(workers, env)


def _probe_pair() -> tuple[socket.socket, socket.socket]:
    """A worker's liveness probe: the starting side's end (non-blocking), and the worker's."""
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    return ours, theirs


def _drain(sock: socket.socket) -> bytes | None:
    """Whatever is waiting on ``sock`` (non-blocking), or None at the end of the stream (or
    once it failed: the worker is gone)."""
    chunks: list[bytes] = []
    try:
        while chunk := sock.recv(256):
            chunks.append(chunk)
    except BlockingIOError:
        return b"".join(chunks)
    except OSError:
        pass
    return None


def _answer_probes(fd: int) -> None:
    """In a worker: answer each probe byte read from ``fd``, from a thread of its own."""
    sock = socket.socket(fileno=fd)

    def run() -> None:
        with contextlib.suppress(OSError):
            while data := sock.recv(256):
                sock.sendall(data[-1:])

    threading.Thread(target=run, name="executor-mp-probe", daemon=True).start()


class _Spare:
    """One spare process, as the side that started it sees it."""

    def __init__(self, ctx: Any, env: dict[str, str], preload: str, death: int, parent: int | None):
        self._ours, theirs = socket.socketpair()
        self.process: BaseProcess = ctx.Process(
            target=_spare_main,
            args=(env, preload, InheritedFd(theirs.fileno()), InheritedFd(death), parent),
            name="executor-mp-spare",
            daemon=True,
        )
        try:
            self.process.start()
        finally:
            theirs.close()  # the child holds its copy, or there is no child
        #: Its process runs a rank now: the group's to stop, not this object's.
        self.handed_over = self._stopped = False

    def hand_over(self, spec: WorkerSpec) -> BaseProcess:
        """Give this spare ``spec``'s rank; it is that rank's worker process from now on."""
        data = pickle.dumps(attrs.evolve(spec, fds=()), protocol=5)
        # Bounded: a spare reads once its imports are done; one that never does is stopped,
        # and the rank gets a new process.
        self._ours.settimeout(60.0)
        with self._ours:
            socket.send_fds(self._ours, [_HEADER.pack(len(data))], [fd.fd for fd in spec.fds])
            self._ours.sendall(data)
        self.handed_over = True
        return self.process

    def stop(self) -> None:
        """End an idle spare (its ``recv`` returns; SIGTERM if it is still importing)."""
        if not (self.handed_over or self._stopped):
            self._stopped = True
            self._ours.close()
            _end([self.process], 5.0)
            if self.process.exitcode is not None:
                self.process.close()


def _end(processes: Sequence[BaseProcess], grace_s: float) -> None:
    """SIGTERM ``processes``, then SIGKILL those still alive after ``grace_s``; reap them."""
    for process in processes:
        process.terminate()
    if not _wait_exit(processes, grace_s):
        for process in processes:
            if process.exitcode is None:
                logger.warning("process %s ignored SIGTERM; sending SIGKILL", process.name)
                process.kill()
        _wait_exit(processes, 5.0)


def _wait_exit(processes: Sequence[BaseProcess], timeout: float) -> bool:
    """Wait up to ``timeout`` for ``processes`` to end; whether they all did."""
    deadline = time.monotonic() + timeout
    while (alive := [p for p in processes if p.exitcode is None]) and (
        remaining := deadline - time.monotonic()
    ) > 0:
        wait_for_ready([p.sentinel for p in alive], remaining)
    return not alive


# --- the group ---------------------------------------------------------------------------


class WorkerGroup:
    """The worker processes of one node's ``channel`` (the i-th reads its i-th rings), and the
    monitor thread that starts and watches them; returns once they are started.

    The monitor starts every process (at start and for a rank replacement): PR_SET_PDEATHSIG
    fires when the *thread* that created a child exits, and the monitor lives as long as the
    workers do. It also gives back the process's idle receive memory (``IdleTrim``): a driver
    reads replies only while a caller waits, so a large reply's memory would otherwise stay
    until the next. It calls ``on_death(index, exitcode)`` when a worker ends while
    :attr:`armed` and not :attr:`closing`. Everything made is handed to ``add_cleanup``.
    """

    def __init__(
        self,
        channel: NodeRings,
        launches: Sequence[WorkerLaunch],
        options: MultiprocOptions,
        add_cleanup: Callable[[Callable[[], None]], None],
        on_death: Callable[[int, int], None],
        spares: int = 0,
        preload: str = "",
    ) -> None:
        self._channel, self._options, self._on_death = channel, options, on_death
        self._ctx: Any = multiprocessing.get_context(options.start_method)
        self._parent_pid = os.getpid() if options.start_method != "forkserver" else None
        self._forked = options.start_method == "fork"
        # Workers read the death pipe: it reaches EOF when this process dies, however it
        # dies. The read end stays open here for the processes of a rank replacement.
        self._death_r, self._death_w = os.pipe()
        #: Each worker's liveness probe: this side's ends, and the workers' (closed here once
        #: handed to their process).
        pairs = [_probe_pair() for _ in launches]
        self._probes, self._probe_ends = [p[0] for p in pairs], [p[1] for p in pairs]
        for fd in (self._death_w, self._death_r):
            add_cleanup(_fd_closer(fd))
        add_cleanup(self._close_probes)
        self._lock = threading.RLock()
        self._wake_r, self._wake_w = os.pipe()
        #: What the monitor is to start: ``({index: start}, done)``.
        self._spawns: list[tuple[dict[int, Callable[[], BaseProcess]], threading.Event]] = []
        self._start_error: BaseException | None = None
        self._token = 0
        self._spare_args = (launches[0].env(rank=False), preload, self._death_r, self._parent_pid)
        self._spare_count = 0 if self._forked else spares
        self._spares_wanted = 0  # until start_spares
        self._spares: list[_Spare] = []
        #: Deaths are reported only once the executor is ready and until it starts closing.
        self.armed = False
        self.closing = False
        self._closed = False
        self._processes = [self._process(i, launch) for i, launch in enumerate(launches)]
        self._thread = threading.Thread(target=self._run, name="executor-mp-monitor", daemon=True)
        self._thread.start()
        try:
            self._spawn({i: functools.partial(_started, p) for i, p in enumerate(self._processes)})
        except BaseException:
            self.stop(0.0)  # those started, and the monitor
            raise
        finally:
            for sock in self._probe_ends:
                sock.close()  # the children hold their copies

    def _spec(self, index: int, launch: WorkerLaunch) -> WorkerSpec:
        fds = (self._death_r, self._probe_ends[index].fileno())
        return WorkerSpec(
            launch=launch,
            layout=self._channel.layout,
            index=index,
            fds=tuple(map(InheritedFd, fds + self._channel.worker_fds(index).as_tuple())),
            parent_pid=self._parent_pid,
            options=self._options,
            close_fds=(self._death_w, *(s.fileno() for s in self._probes)) if self._forked else (),
        )

    def _process(self, index: int, launch: WorkerLaunch) -> BaseProcess:
        process: BaseProcess = self._ctx.Process(
            target=worker_main,
            args=(self._spec(index, launch),),
            name=f"executor-mp-worker-{launch.rank}",
            daemon=True,
        )
        return process

    def exit_code(self, rank: int) -> int | None:
        """The exit code of ``rank`` if it has ended (negative: killed by that signal)."""
        with self._lock:
            process = self._processes[rank]
            return None if process.pid is None or self._closed else process.exitcode

    def _run(self) -> None:
        """The monitor: start what it is asked to, watch the sentinels until every worker
        ended and the group is closing (a worker may be replaced even when it was the last
        one alive); meanwhile trim."""
        trim = IdleTrim()  # this thread's own: made, used and closed here
        watched: dict[int, int] = {}  # sentinel: index
        wake: list[int] = [self._wake_r, trim.fileno()]
        try:
            while watched or (wake and not self.closing):
                timeout = trim.timeout() if wake else None
                ready = [
                    fd for fd in wait_for_ready([*watched, *wake], timeout) if isinstance(fd, int)
                ]
                if self._wake_r in ready:
                    if self.closing or self._closed:
                        wake = []  # it stays readable; from now on only sentinels matter
                    else:  # processes to start, or spares
                        with contextlib.suppress(OSError):
                            os.read(self._wake_r, 64)
                        self._start_spawns(watched)
                        self._top_up_spares()
                if wake:
                    trim.run()  # trims only if a trim is due
                for sentinel in ready:
                    index = watched.pop(sentinel, None)
                    if index is None:
                        continue
                    with self._lock:
                        if self._closed:  # stopped from a failure callback run by this thread
                            return
                        # The sentinel closes a moment before the process can be reaped.
                        self._processes[index].join(1.0)
                    code = self.exit_code(index)
                    if self.armed and not self.closing:
                        try:
                            self._on_death(index, code if code is not None else -1)
                        except Exception:
                            logger.exception("handling the death of worker rank %d failed", index)
        finally:
            trim.close()
            # The workers are gone: what this process kept warm for their messages is of
            # no more use.
            IdleTrim.release()

    def _start_spawns(self, watched: dict[int, int]) -> None:
        with self._lock:
            spawns, self._spawns = self._spawns, []
        for starts, done in spawns:
            for index, start in starts.items():
                old = self._processes[index]
                for sentinel in [fd for fd, i in watched.items() if i == index]:
                    del watched[sentinel]  # the old process's death is not news any more
                try:
                    process = start()
                except BaseException as exc:  # noqa: BLE001 - handed to the thread in _spawn
                    self._start_error = exc
                    break
                with self._lock:
                    if self.closing:  # stop() ended the others meanwhile: this one too
                        process.kill()
                        process.join(5.0)
                    self._processes[index] = process
                watched[process.sentinel] = index
                if old is not process:
                    old.close()  # its sentinel, after the new one is open: none is reused
            done.set()

    def _spawn(self, starts: dict[int, Callable[[], BaseProcess]]) -> None:
        """Have the monitor start these processes; return once it has."""
        done = threading.Event()
        with self._lock:
            if self._closed or self.closing:
                raise RuntimeError("the worker group is closing")
            self._start_error = None
            self._spawns.append((starts, done))
        self._wake()
        deadline = time.monotonic() + 60.0
        while not done.wait(0.05):
            if self.closing or self._closed:
                raise RuntimeError("the worker group closed while workers were being started")
            if time.monotonic() >= deadline or not self._thread.is_alive():
                raise TimeoutError("worker processes were not started within 60 s")
        if self._start_error is not None:
            raise self._start_error

    def start_spares(self) -> None:
        """Keep the spares from now on (the ranks are ready: a spare started earlier would
        compete with them for the CPU)."""
        if self._spare_count:
            self._spares_wanted = self._spare_count
            self._wake()

    def _top_up_spares(self) -> None:
        while self._wants_spare():
            try:
                spare = _Spare(self._ctx, *self._spare_args)
            except Exception:
                logger.warning("a warm spare worker could not be started", exc_info=True)
                self._spares_wanted = 0
                return
            with self._lock:
                if self._wants_spare():
                    self._spares.append(spare)
                    continue
            spare.stop()  # stop() took the others meanwhile
            return

    def _wants_spare(self) -> bool:
        with self._lock:
            return not self.closing and len(self._spares) < self._spares_wanted

    def replace(
        self, launches: Sequence[WorkerLaunch], first_rank: int
    ) -> list[tuple[int, Exception]]:
        """Rank replacement: a spare or a new process for each launch (its rank's old one is
        killed if it is not gone), on the same rings, reset so that it reads from the next call
        written and writes into an empty reply ring, with a new probe; return once they are
        started, with the ranks that could not be, and why."""
        failed: list[tuple[int, Exception]] = []
        for launch in launches:
            index = launch.rank - first_rank
            spare = None
            try:
                with self._lock:
                    old = self._processes[index]
                    if old.pid is not None and old.exitcode is None:
                        old.kill()
                    old.join(5.0)
                    while self._spares and spare is None:  # an idle one, replaced at once
                        spare = self._spares.pop(0)
                        if spare.process.exitcode is not None:
                            spare.stop()
                            spare = None
                self._channel.resume_worker(index)
                self._probes[index].close()
                self._probes[index], self._probe_ends[index] = _probe_pair()
                self._spawn({index: functools.partial(self._replacement, index, launch, spare)})
            except Exception as exc:  # noqa: BLE001 - returned: reported as a death
                failed.append((launch.rank, exc))
            finally:
                if spare is not None:
                    spare.stop()  # unless it runs the rank now
                self._probe_ends[index].close()
        return failed

    def probe(self, indices: Iterable[int], timeout: float) -> set[int]:
        """The workers among ``indices`` that did not answer their probe within ``timeout``
        seconds (a byte each echoes from a thread of its own)."""
        self._token = self._token % 255 + 1  # never 0: tells this probe from earlier ones
        token = bytes([self._token])
        pending: dict[socket.socket, int] = {}
        silent: set[int] = set()
        for index in indices:
            sock = self._probes[index]
            try:
                _drain(sock)  # late answers to an earlier probe
                sock.send(token)
                pending[sock] = index
            except OSError:  # the worker's end is closed: the process is gone
                silent.add(index)
        deadline = time.monotonic() + timeout
        while pending and (remaining := deadline - time.monotonic()) > 0:
            for sock in wait_for_ready(list(pending), remaining):  # type: ignore[assignment]
                answer = _drain(sock)
                if answer is None or answer.endswith(token):  # gone, or answered
                    index = pending.pop(sock)
                    if answer is None:
                        silent.add(index)
        return silent | set(pending.values())

    def _replacement(self, index: int, launch: WorkerLaunch, spare: _Spare | None) -> BaseProcess:
        """Monitor thread: hand the rank to ``spare``, or (without one, or if the hand-over
        fails) start a new process."""
        if spare is not None:
            try:
                return spare.hand_over(self._spec(index, launch))
            except OSError as exc:
                logger.warning("rank %d: a new process, the spare failed: %s", launch.rank, exc)
                spare.stop()
        return _started(self._process(index, launch))

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _close_probes(self) -> None:
        for sock in (*self._probes, *self._probe_ends):
            sock.close()

    def _alive(self) -> list[BaseProcess]:
        return [p for p in self._processes if p.pid is not None and p.exitcode is None]

    def terminate(self, grace_s: float) -> None:
        """SIGTERM the live workers, then SIGKILL those still alive after ``grace_s``."""
        with self._lock:
            if not self._closed:  # else stopped and reaped (e.g. shutdown from a callback)
                _end(self._alive(), grace_s)

    def stop(self, grace_s: float) -> None:
        """Wait ``grace_s`` for the workers to exit by themselves, then SIGTERM, then SIGKILL
        after ``grace_s`` again (1 s if 0); reap them and join the monitor. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self.closing = True
            spares, self._spares = self._spares, []
            for spare in spares:
                spare.stop()
            if not _wait_exit(self._alive(), grace_s):
                _end(self._alive(), grace_s or 1.0)
            self._closed = True
        self._wake()
        if self._thread is not threading.current_thread():
            self._thread.join(10.0)
        for process in self._processes:
            if process.pid is not None and process.exitcode is not None:
                process.close()  # releases the sentinel descriptor
        for fd in (self._wake_r, self._wake_w):
            _fd_closer(fd)()

    def kill(self, indices: Iterable[int]) -> None:
        """SIGKILL the workers at ``indices`` now (declared hung)."""
        with self._lock:
            for index in indices:
                process = self._processes[index]
                if process.pid is not None and process.exitcode is None:
                    process.kill()


def _started(process: BaseProcess) -> BaseProcess:
    process.start()
    return process


def _fd_closer(fd: int) -> Callable[[], None]:
    def close() -> None:
        with contextlib.suppress(OSError):
            os.close(fd)

    return close
