"""The worker processes of one executor: start, watch, stop.

A monitor thread starts the processes and then watches their sentinels. Starting them from
that thread matters: PR_SET_PDEATHSIG fires when the *thread* that created a child exits,
and the monitor lives exactly as long as the workers do, whichever thread created the
executor.

The monitor also gives back the process's idle receive memory (``executor_channel.IdleTrim``):
a driver reads replies only while a caller waits, so without it the memory of a large reply
would stay until the next one came. It sleeps without a timeout unless the receive cache
keeps memory, then wakes ``IDLE_S`` after the last large message (and every ``IDLE_S`` while
a received object is still referenced) to give back what is free.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait as wait_for_ready
from multiprocessing.process import BaseProcess

from executor_channel import IdleTrim

from ._probe import Probes
from ._spare import Spare

__all__ = ["WorkerGroup"]

logger = logging.getLogger("executor_plugin_multiproc")

#: Called from the monitor thread with (rank, exit code) when a worker ends unasked.
DeathCallback = Callable[[int, int], None]


class WorkerGroup:
    """Worker processes indexed by rank, and the thread that watches them."""

    def __init__(
        self, processes: Sequence[BaseProcess], on_death: DeathCallback, probes: Probes
    ) -> None:
        self._processes = list(processes)
        #: Their liveness probes, by index.
        self.probes = probes
        self._on_death = on_death
        self._lock = threading.RLock()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._wake_r, self._wake_w = os.pipe()
        #: Processes to start from the monitor thread (rank replacement): ``(index, start,
        #: done)``, ``start()`` returning the started process, under the lock.
        self._spawns: list[tuple[int, Callable[[], BaseProcess], threading.Event]] = []
        #: What made the processes (``_local``), for a rank replacement's new one.
        self.starter: object = None
        #: Warm spares (``_spare``): what makes one, how many to keep (none until
        #: :meth:`start_spares`), the idle ones.
        self.make_spare: Callable[[], Spare] | None = None
        self.spares_wanted = 0
        self._spares_on = False
        self._spares: list[Spare] = []
        #: Deaths are reported only once the executor is ready and until it starts closing.
        self.armed = False
        self.closing = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="executor-mp-monitor", daemon=True)

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self._processes]

    def start(self, timeout: float = 60.0) -> None:
        """Start every process (from the monitor thread) and return once they are started."""
        self._thread.start()
        if not self._started.wait(timeout):
            raise TimeoutError(f"worker processes were not started within {timeout:g} s")
        if self._start_error is not None:
            raise self._start_error

    def exit_code(self, rank: int) -> int | None:
        """The exit code of ``rank`` if it has ended (negative: killed by that signal)."""
        with self._lock:
            process = self._processes[rank]
            if process.pid is None or self._closed:
                return None
            return process.exitcode

    def _run(self) -> None:
        try:
            for process in self._processes:
                process.start()
        except BaseException as exc:  # noqa: BLE001 - handed to the thread that called start()
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        trim = IdleTrim()  # this thread's own: made, used and closed here
        try:
            self._watch(trim)
        finally:
            trim.close()
            # The workers are gone: what this process kept warm for their messages is of no
            # more use (another executor's next large message finds the heap as it would).
            IdleTrim.release()

    def _watch(self, trim: IdleTrim) -> None:
        """Watch the sentinels until every worker ended or the group is closed; meanwhile
        give back idle receive memory, until :meth:`stop` wakes this thread."""
        watched = {p.sentinel: rank for rank, p in enumerate(self._processes)}
        wake: list[int] = [self._wake_r, trim.fileno()]
        trimming = True
        # Until every worker ended and the group is closing: a worker may be replaced even
        # when it was the last one alive.
        while watched or (wake and not self.closing):
            timeout = trim.timeout() if trimming else None
            ready = [fd for fd in wait_for_ready([*watched, *wake], timeout) if isinstance(fd, int)]
            if self._wake_r in ready:
                if self.closing or self._closed:
                    wake = []  # it stays readable; from now on only sentinels matter
                    trimming = False
                else:  # a process to start in place of a dead one
                    with contextlib.suppress(OSError):
                        os.read(self._wake_r, 64)
                    self._start_spawns(watched)
                    self._top_up_spares()
            if trimming:
                trim.run()  # after any wake: trims only if a trim is due
            for sentinel in ready:
                rank = watched.pop(sentinel, None)
                if rank is None:
                    continue
                with self._lock:
                    if self._closed:  # stopped from a failure callback run by this thread
                        return
                    # The sentinel closes a moment before the process can be reaped; join
                    # waits for that moment (waitpid), so the exit code is known.
                    self._processes[rank].join(1.0)
                code = self.exit_code(rank)
                if self.armed and not self.closing:
                    try:
                        self._on_death(rank, code if code is not None else -1)
                    except Exception:
                        logger.exception("handling the death of worker rank %d failed", rank)

    def _start_spawns(self, watched: dict[int, int]) -> None:
        """Monitor thread: start the processes :meth:`respawn` queued and watch them."""
        with self._lock:
            spawns, self._spawns = self._spawns, []
        for index, start, done in spawns:
            old = self._processes[index]
            for sentinel in [fd for fd, rank in watched.items() if rank == index]:
                del watched[sentinel]  # the old process's death is not news any more
            try:
                process = start()
            except BaseException as exc:  # noqa: BLE001 - handed to the thread in respawn()
                self._start_error = exc
            else:
                with self._lock:
                    if self.closing:  # stop() ended the others meanwhile: this one too
                        process.kill()
                        process.join(5.0)
                    self._processes[index] = process
                watched[process.sentinel] = index
                old.close()  # its sentinel, after the new one is open: no number is reused
            done.set()

    def start_spares(self) -> None:
        """Keep :attr:`spares_wanted` spares from now on (the ranks are ready: a spare
        started earlier would compete with them for the CPU)."""
        if self.make_spare is not None and self.spares_wanted:
            self._spares_on = True
            self.wake_monitor()

    def take_spare(self) -> Spare | None:
        """An idle spare, taken out of the pool (a new one is started in its place)."""
        with self._lock:
            while self._spares:
                spare = self._spares.pop(0)
                if spare.alive:
                    self.wake_monitor()
                    return spare
                spare.stop()
        return None

    def _top_up_spares(self) -> None:
        """Monitor thread (see the module): start spares until there are enough."""
        make = self.make_spare
        while make is not None and self._spares_on and self._wants_spare():
            spare = make()
            try:
                spare.start()
            except Exception:
                logger.warning("a warm spare worker could not be started", exc_info=True)
                self._spares_on = False
                return
            with self._lock:
                if self._wants_spare():
                    self._spares.append(spare)
                    continue
            spare.stop()  # stop() took the others meanwhile
            return

    def _wants_spare(self) -> bool:
        with self._lock:
            return not self.closing and len(self._spares) < self.spares_wanted

    def respawn(self, index: int, start: Callable[[], BaseProcess], timeout: float = 60.0) -> None:
        """Start a process in place of worker ``index``, whose process is gone (killed here
        if it is not), from the monitor thread (see the module): ``start()`` starts it (or
        hands the rank to a spare) and returns it; return once it is started."""
        with self._lock:
            if self._closed or self.closing:
                raise RuntimeError("the worker group is closing")
            old = self._processes[index]
            if old.pid is not None and old.exitcode is None:
                old.kill()
            old.join(5.0)
            if old.exitcode is None:
                raise RuntimeError(f"worker {old.name} (pid {old.pid}) did not end")
            done = threading.Event()
            self._start_error = None
            self._spawns.append((index, start, done))
        self.wake_monitor()
        deadline = time.monotonic() + timeout
        while not done.wait(0.05):
            if self.closing or self._closed:
                raise RuntimeError("the worker group closed while a worker was being replaced")
            if time.monotonic() >= deadline or not self._thread.is_alive():
                raise TimeoutError(
                    f"worker {old.name}'s replacement was not started within {timeout:g} s"
                )
        if self._start_error is not None:
            raise self._start_error

    def wake_monitor(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _alive(self) -> list[BaseProcess]:
        return [p for p in self._processes if p.pid is not None and p.exitcode is None]

    def _wait_exit(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            alive = self._alive()
            remaining = deadline - time.monotonic()
            if not alive or remaining <= 0:
                return not alive
            wait_for_ready([p.sentinel for p in alive], remaining)

    def terminate(self, grace_s: float) -> None:
        """SIGTERM the live workers, then SIGKILL those still alive after ``grace_s``."""
        with self._lock:
            if self._closed:  # already stopped and reaped (e.g. shutdown from a callback)
                return
            for process in self._alive():
                process.terminate()
            if not self._wait_exit(grace_s):
                for process in self._alive():
                    logger.warning("worker %s ignored SIGTERM; sending SIGKILL", process.name)
                    process.kill()
                self._wait_exit(5.0)

    def stop(self, grace_s: float, term_grace_s: float) -> None:
        """Wait ``grace_s`` for the workers to exit by themselves, then SIGTERM, then SIGKILL
        after ``term_grace_s``; reap them and join the monitor. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self.closing = True
            spares, self._spares = self._spares, []
            for spare in spares:
                spare.stop()
            if self._started.is_set() and not self._wait_exit(grace_s):
                self.terminate(term_grace_s)
            self._closed = True
        self.wake_monitor()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(10.0)
        for process in self._processes:
            if process.pid is not None and process.exitcode is not None:
                process.close()  # releases the sentinel descriptor
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def kill(self, indices: Sequence[int]) -> None:
        """SIGKILL the workers at ``indices`` now (declared hung; stopped ones die too)."""
        with self._lock:
            for index in indices:
                process = self._processes[index]
                if process.pid is not None and process.exitcode is None:
                    process.kill()

    def kill_now(self) -> None:
        """Cleanup path (finalizer, failed start): no wait for a stop message."""
        self.stop(0.0, 1.0)
