"""Backends that each break one rule of the contract, for the conformance kit's own tests.

Each is the example ``threads`` backend with one defect that a real plugin author made (see
the issue that introduced the kit): the kit must fail every one of them, naming the rule.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar

from executor_core import Executor, WorkerContext, WorkerDiedError, WorkerError
from executor_core.backend import Call, Transport, TransportHost, WorkerWrapper
from executor_threads._executor import Queue, ThreadExecutor, ThreadTransport

#: Name prefix of the /dev/shm segments the leaking backends make (a test removes them).
LEAK_PREFIX = "executor-kit-test-leak-"


class _Variant(ThreadTransport):
    """The threads transport with switches for the defects below."""

    defect: ClassVar[str] = ""

    def start(self) -> None:
        if self.defect in ("empty_backend_name", "local_rank_zero", "no_hooks"):
            self.host = _DefectiveHost(self.host, self.defect)
        if self.defect == "stray_thread":
            # A helper thread nobody stops (a heartbeat, say).
            threading.Thread(target=_forever, name="stray-heartbeat", daemon=True).start()
        super().start()

    def close(self, graceful: bool) -> None:
        if self.defect == "never_stop":
            return
        if self.defect == "unbounded_shutdown":  # waits for ever on a rank hung in a call
            for calls in self.queues:
                calls.put(None)
            for thread in self.threads:
                thread.join()
            return
        if self.defect in ("skip_wrapper_shutdown", "worker_shutdown_directly"):
            for thread_wrapper in getattr(self, "wrappers", []):
                thread_wrapper.skip = self.defect
        super().close(graceful)


def _forever() -> None:
    while True:
        time.sleep(0.1)


class _DefectiveHost:
    """Wraps the core's host and gets one thing wrong."""

    def __init__(self, host: TransportHost, defect: str) -> None:
        self._host = host
        self._defect = defect

    def __getattr__(self, name: str) -> Any:
        return getattr(self._host, name)

    def contexts(self) -> list[WorkerContext]:
        contexts = self._host.contexts()
        if self._defect == "empty_backend_name":
            return [_evolve(c, backend="") for c in contexts]
        if self._defect == "local_rank_zero":
            return [_evolve(c, local_rank=0) for c in contexts]
        return contexts

    def wrapper(self, context: WorkerContext) -> WorkerWrapper:
        wrapper = self._host.wrapper(context)
        if self._defect == "no_hooks":
            config = self._host.config
            # Forgets to pass the registry's hooks: the wrapper loads its own.
            return WorkerWrapper(config.worker_cls, config.worker_kwargs, context, env=config.env)
        return wrapper


def _evolve(context: WorkerContext, **changes: Any) -> WorkerContext:
    import attrs

    return attrs.evolve(context, **changes)


class _ShutdownDefectWrapper(WorkerWrapper):
    """A wrapper whose shutdown is skipped, or bypassed (worker shut down without hooks)."""

    skip = ""

    def shutdown(self) -> None:
        if self.skip == "skip_wrapper_shutdown":
            return
        if self.skip == "worker_shutdown_directly":
            worker, self.worker = self.worker, None
            if worker is not None:
                worker.shutdown()
            return
        super().shutdown()


class _ShutdownDefects(_Variant):
    def start(self) -> None:
        host = self.host
        self.wrappers: list[_ShutdownDefectWrapper] = []

        def wrapper(context: WorkerContext) -> WorkerWrapper:
            made = _ShutdownDefectWrapper(
                host.config.worker_cls,
                host.config.worker_kwargs,
                context,
                env=host.config.env,
                hooks=host.wrapper(context).hooks,
            )
            self.wrappers.append(made)
            return made

        self.host = _WrapperHost(host, wrapper)
        super().start()


class _WrapperHost:
    def __init__(self, host: TransportHost, wrapper: Any) -> None:
        self._host = host
        self.wrapper = wrapper

    def __getattr__(self, name: str) -> Any:
        return getattr(self._host, name)


class _FirstFailureWins(_Variant):
    """Short-circuits a call on the first failure: every rank is reported failed with it."""

    def start(self) -> None:
        host = self.host
        transport = self

        class Host(_WrapperHost):
            def deliver(self, seq: int, rank: int, ok: bool, value: Any) -> None:
                if ok:
                    host.deliver(seq, rank, ok, value)
                    return
                name = transport.names.get(seq, "?")
                error = WorkerError.from_exception(rank, name, value)  # keeps its rank
                for other in range(host.config.world_size):
                    host.deliver(seq, other, ok, error)

        self.names: dict[int, str] = {}
        self.host = Host(host, host.wrapper)  # type: ignore[assignment]
        super().start()

    def send(self, call: Call) -> bool:
        self.names[call.seq] = call.name
        return super().send(call)


class _MislabelledReplies(_Variant):
    """Delivers each reply under another rank's number: swapped (``ws - 1 - rank``), or every
    reply as rank 0's (a transport that forgot which rank's pipe it read)."""

    def start(self) -> None:
        host = self.host
        world_size = host.config.world_size
        swap = self.defect == "swapped_reply_ranks"

        class Host(_WrapperHost):
            def deliver(self, seq: int, rank: int, ok: bool, value: Any) -> None:
                host.deliver(seq, world_size - 1 - rank if swap else 0, ok, value)

        self.host = Host(host, host.wrapper)  # type: ignore[assignment]
        super().start()


class _RepliesByArrival(_Variant):
    """Labels replies by their order of arrival (it reads them from one queue and forgot
    which rank's each is): the first reply to a call is rank 0's. Ranks that answer as fast
    as each other often answer in rank order: the defect shows for sure only where a
    higher rank answers first."""

    def start(self) -> None:
        host, arrived, lock = self.host, dict[int, int](), threading.Lock()

        class Host(_WrapperHost):
            def deliver(self, seq: int, rank: int, ok: bool, value: Any) -> None:
                with lock:
                    label = arrived[seq] = arrived.get(seq, -1) + 1
                host.deliver(seq, label, ok, value)

        self.host = Host(host, host.wrapper)  # type: ignore[assignment]
        super().start()


class _RacySends(_RepliesByArrival):
    """:class:`_RepliesByArrival` that sends to each rank from a thread of its own (one outbox
    per rank), so that the ranks' replies arrive in either order."""

    def start(self) -> None:
        super().start()
        self.outboxes: list[queue.SimpleQueue[Call | None]] = []
        self.senders = []
        for calls in self.queues:
            self.outboxes.append(queue.SimpleQueue())
            self.senders.append(threading.Thread(target=_forward, args=(self.outboxes[-1], calls)))
            self.senders[-1].start()

    def send(self, call: Call) -> bool:
        for outbox in self.outboxes:
            outbox.put(call)
        return True

    def close(self, graceful: bool) -> None:
        for outbox in getattr(self, "outboxes", []):
            outbox.put(None)
        for sender in getattr(self, "senders", []):
            sender.join(2.0)
        super().close(graceful)


def _forward(outbox: queue.SimpleQueue[Call | None], calls: Queue) -> None:
    while (call := outbox.get()) is not None:
        calls.put(call)


def _leak_shm_segment(name: str) -> mmap.mmap:
    """Create and map ``/dev/shm/<LEAK_PREFIX><name>``, and never unmap or unlink it (the test
    that plants it removes it afterwards)."""
    fd = os.open(f"/dev/shm/{LEAK_PREFIX}{name}", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 4096)
        return mmap.mmap(fd, 4096)
    finally:
        os.close(fd)


_LEAKED: list[Any] = []  # what the leaking backends keep alive


class _LeavesShm(_Variant):
    """Maps a named shared-memory segment for its workers and never unmaps or unlinks it."""

    def start(self) -> None:
        _LEAKED.append(_leak_shm_segment(f"{os.getpid()}-{id(self)}"))
        super().start()


class _LeavesTempDir(_Variant):
    """Makes a scratch directory for its workers and never removes it (the test process
    removes it at its exit, so that the suite itself leaves nothing behind)."""

    def start(self) -> None:
        self.scratch = tempfile.mkdtemp(prefix="executor-threads-scratch-")
        atexit.register(shutil.rmtree, self.scratch, ignore_errors=True)
        super().start()


class _OutboxPerCaller(_Variant):
    """Gives each calling thread an outbox thread of its own, which puts the call on every
    rank's queue, one rank after the other (a short pause between ranks), without one lock
    around all of them: one thread's calls stay in order, but calls from several threads
    reach the ranks in different orders."""

    def start(self) -> None:
        self.outboxes: dict[int, queue.SimpleQueue[Call | None]] = {}
        self.outbox_threads: list[threading.Thread] = []
        self.outbox_lock = threading.Lock()
        super().start()

    def _fan_out(self, outbox: queue.SimpleQueue[Call | None]) -> None:
        while (call := outbox.get()) is not None:
            for calls in self.queues:
                calls.put(call)
                time.sleep(0.0002)

    def send(self, call: Call) -> bool:
        caller = threading.get_ident()
        with self.outbox_lock:
            outbox = self.outboxes.get(caller)
            if outbox is None:
                outbox = self.outboxes[caller] = queue.SimpleQueue()
                thread = threading.Thread(
                    target=self._fan_out, args=(outbox,), name="threads-outbox", daemon=True
                )
                self.outbox_threads.append(thread)
                thread.start()
        outbox.put(call)
        return True

    def close(self, graceful: bool) -> None:
        for outbox in getattr(self, "outboxes", {}).values():
            outbox.put(None)
        for thread in getattr(self, "outbox_threads", []):
            thread.join(2.0)
        super().close(graceful)


class _SendIgnoresDeadline(_Variant):
    """Streams a call bigger than its 1 MiB "ring" to each rank, waiting until the rank has
    taken it, ignoring ``call.deadline`` (it stops only when interrupted): with a rank hung,
    such a call never returns by its deadline."""

    ring_bytes: ClassVar[int] = 1 << 20

    def start(self) -> None:
        self.interrupted = threading.Event()
        super().start()

    def send(self, call: Call) -> bool:
        size = sum(len(a) for a in call.args if isinstance(a, bytes | bytearray))
        if size <= self.ring_bytes:
            return super().send(call)
        for calls in self.queues:
            calls.put(call)
            while calls.qsize() and not self.interrupted.is_set():
                time.sleep(0.001)  # the defect: no check of call.deadline
        return True

    def interrupt(self) -> None:
        self.interrupted.set()


def _executor(transport: type[ThreadTransport], **attrs_: Any) -> type[ThreadExecutor]:
    return type(
        f"Broken{transport.__name__}", (ThreadExecutor,), {"transport_cls": transport, **attrs_}
    )


def _variant(defect: str, base: type[_Variant] = _Variant) -> type[ThreadTransport]:
    return type(f"{defect.title().replace('_', '')}Transport", (base,), {"defect": defect})


class _HoldsExecutor(ThreadExecutor):
    """Hands the executor to its transport, whose threads then keep it alive."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.transport.owner = self  # type: ignore[attr-defined]


class _IgnoresNonBlockTimeout(ThreadExecutor):
    """Drops ``timeout`` on non-blocking calls (re-implements the entry of a call)."""

    def collective_rpc(
        self,
        method: Any,
        timeout: Any = None,
        args: Any = (),
        kwargs: Any = None,
        non_block: bool = False,
        unique_reply_rank: Any = None,
    ) -> Any:  # type: ignore[override]
        if non_block:
            timeout = None
        return super().collective_rpc(method, timeout, args, kwargs, non_block, unique_reply_rank)


class _SkipsReplyRankCheck(ThreadExecutor):
    """Forgets to validate ``unique_reply_rank`` (re-implements the entry of a call)."""

    def collective_rpc(
        self,
        method: Any,
        timeout: Any = None,
        args: Any = (),
        kwargs: Any = None,
        non_block: bool = False,
        unique_reply_rank: Any = None,
    ) -> Any:  # type: ignore[override]
        expected = self._recovery.ranks
        if unique_reply_rank in expected:
            expected = (unique_reply_rank,)
        else:  # not checked: a rank out of range is taken for one this process does not drive
            unique_reply_rank = None
        args = tuple(args)
        return self._call(method, timeout, args, kwargs, non_block, unique_reply_rank, expected)


#: Each broken backend, with the words the kit's failure must contain.
BROKEN: dict[str, tuple[type[ThreadExecutor], str]] = {
    "holds_executor": (_HoldsExecutor, "garbage-collected"),
    "ignores_non_block_timeout": (_IgnoresNonBlockTimeout, "timeout applies to non_block"),
    "skips_reply_rank_check": (_SkipsReplyRankCheck, "unique_reply_rank that is not a rank"),
    "skips_wrapper_shutdown": (
        _executor(_variant("skip_wrapper_shutdown", _ShutdownDefects)),
        "runs every worker's shutdown",
    ),
    "worker_shutdown_without_hook": (
        _executor(_variant("worker_shutdown_directly", _ShutdownDefects)),
        "executor_worker_stopping hook did not run",
    ),
    "empty_backend_name": (
        _executor(_variant("empty_backend_name")),
        "WorkerContext.backend names the backend",
    ),
    "local_rank_zero": (_executor(_variant("local_rank_zero")), "local ranks on node"),
    "no_hooks": (_executor(_variant("no_hooks")), "worker hooks reach rank"),
    "threads_never_stop": (_executor(_variant("never_stop")), "runs every worker's shutdown"),
    "stray_thread": (_executor(_variant("stray_thread")), "left behind after shutdown()"),
    "first_failure_wins": (_executor(_FirstFailureWins), "lowest failing rank"),
    "swapped_reply_ranks": (
        _executor(_variant("swapped_reply_ranks", _MislabelledReplies)),
        "replies carry the rank they came from",
    ),
    "replies_all_from_rank_zero": (
        _executor(_variant("replies_all_from_rank_zero", _MislabelledReplies)),
        "replies carry the rank they came from",
    ),
    "leaves_temp_dir": (
        _executor(_LeavesTempDir),
        "temporary files and directories the backend creates are gone",
    ),
    "outbox_per_caller": (
        _executor(_OutboxPerCaller),
        "calls from several threads reach every rank in one order",
    ),
    "send_ignores_deadline": (
        _executor(_SendIgnoresDeadline),
        "a call that cannot be sent fails by its deadline",
    ),
    "racy_sends": (_executor(_RacySends), "replies carry the rank they came from"),
    "replies_by_arrival": (_executor(_RepliesByArrival), "replies carry the rank they came from"),
    "unbounded_shutdown": (
        _executor(_variant("unbounded_shutdown")),
        "shutdown() with a rank hung",
    ),
    "leaves_shm_segment": (_executor(_LeavesShm), "left behind after shutdown()"),
}

#: Rules of the kit that no variant of ``threads`` can break, and why (``BROKEN_PROCESSES``
#: breaks them on a backend of worker processes).
NOT_EXPRESSIBLE: dict[str, str] = {
    "test_a_death_is_reported_once_as_a_death": (
        "its workers are threads of the driver's process (they report the driver's pid): "
        "there is no worker process to kill"
    ),
}


# --- a backend of worker processes, for the recovery rules ----------------------------------


def _answer_probes(probe: Any) -> None:
    with contextlib.suppress(EOFError, OSError):
        while True:
            probe.send(probe.recv())


def _serve_pipe(portable: bytes, conn: Any, probe: Any, defect: str) -> None:
    """A worker process: start the worker, say ready, run each call, answer; a thread
    answers the liveness probe."""
    import pickle

    from executor_core.backend import RemoteFailure

    threading.Thread(target=_answer_probes, args=(probe,), daemon=True).start()
    if defect == "worker_leaks_shm":
        _LEAKED.append(_leak_shm_segment(f"worker-{os.getpid()}"))

    wrapper = pickle.loads(portable)
    try:
        wrapper.init_worker()
    except Exception as exc:  # noqa: BLE001 - shipped to the driver as the start's error
        conn.send(("ready", False, RemoteFailure.capture(wrapper.context.rank, "init_worker", exc)))
        return
    conn.send(("ready", True, None))
    while True:
        message = conn.recv()
        if message is None:
            wrapper.shutdown()
            return
        seq, method, args, kwargs, reply_rank = message
        reply = wrapper.handle(method, args, kwargs, reply_rank)
        if reply is not None:
            conn.send((seq, *reply))


class _Processes(Transport):
    """A process per rank over a pipe each; ``defect`` breaks one recovery rule."""

    defect: ClassVar[str] = ""
    incarnations: ClassVar[int] = 0

    def start(self) -> None:
        self.interrupted = threading.Event()
        if self.defect == "leaks_per_restart":  # keeps every incarnation's host alive
            _LEAKED.append(self.host)
        _Processes.incarnations += 1
        nodes = None
        if self.defect == "renames_nodes":  # each incarnation on "another node"
            nodes = [f"node-{_Processes.incarnations}"] * self.host.config.world_size
        self.nodes = nodes
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.probes: list[Any] = []
        for context in self.host.contexts(nodes):
            process, parent, ours = self._spawn(context)
            self.procs.append(process)
            self.conns.append(parent)
            self.probes.append(ours)
        for rank in range(len(self.conns)):
            self._await_ready(rank)
        self.lock = threading.Lock()
        self.readers = [
            threading.Thread(target=self._read, args=(rank,), daemon=True)
            for rank in range(len(self.conns))
        ]
        for reader in self.readers:
            reader.start()

    def _spawn(self, context: WorkerContext) -> tuple[Any, Any, Any]:
        import multiprocessing
        import pickle

        spawn = multiprocessing.get_context("spawn")
        parent, child = spawn.Pipe()
        ours, theirs = spawn.Pipe()
        portable = pickle.dumps(self.host.wrapper(context).portable())
        args = (portable, child, theirs, self.defect)
        process = spawn.Process(target=_serve_pipe, args=args, daemon=True)
        process.start()
        child.close()
        theirs.close()
        return process, parent, ours

    def _await_ready(self, rank: int) -> None:
        conn, deadline = self.conns[rank], time.monotonic() + 30
        while not conn.poll(0.05):  # ends promptly after interrupt() (a replacement given up)
            if self.interrupted.is_set():
                raise RuntimeError(f"interrupted while rank {rank} started")
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank} did not start")
        _, ok, failure = conn.recv()
        if not ok:
            raise failure.to_error()

    def _read(self, rank: int) -> None:
        conn = self.conns[rank]
        while True:
            try:
                seq, ok, value = conn.recv()
            except (EOFError, OSError):
                process = self.procs[rank]
                process.join(1.0)
                code = process.exitcode
                if self.defect == "death_unreported":
                    return
                if code is not None and self.host.closed_error is None:
                    signal_ = -code if code < 0 else None
                    exit_ = code if code >= 0 else None
                    self.host.worker_died(WorkerDiedError(rank, exit_, signal_))
                return
            self.host.deliver(seq, rank, ok, value)

    def send(self, call: Call) -> bool:
        message = (call.seq, call.wire_method, call.args, call.kwargs, call.reply_rank)
        with self.lock:
            for conn in self.conns:
                # A worker gone: its reader reports the death.
                with contextlib.suppress(OSError):
                    conn.send(message)
        return True

    def probe(self, ranks: Sequence[int], timeout: float) -> set[int]:
        if self.defect == "probe_blind":  # everyone "answers"
            return set()
        if self.defect == "probe_blames_busy":  # a rank in a call "does not answer"
            return set(ranks)
        deadline = time.monotonic() + timeout
        silent = set()
        for rank in ranks:
            pipe = self.probes[rank]
            try:
                pipe.send(rank)
                answered = pipe.poll(max(0.0, deadline - time.monotonic()))
                if answered:
                    pipe.recv()
            except (EOFError, OSError):
                answered = False
            if not answered:
                silent.add(rank)
        return silent

    def interrupt(self) -> None:
        self.interrupted.set()

    def kill(self, ranks: Sequence[int]) -> None:
        if self.defect == "kill_forgets":
            return
        for rank in ranks:
            self.procs[rank].kill()

    def close(self, graceful: bool) -> None:
        procs = getattr(self, "procs", [])
        for conn in getattr(self, "conns", []):
            with contextlib.suppress(OSError):
                conn.send(None)
        for process in procs:
            if self.defect == "leaves_survivors" and not graceful:
                continue  # a forced stop forgets the workers still alive
            process.join(2.0 if graceful else 0.0)
            if process.is_alive():
                process.kill()
                process.join(2.0)
        for reader in getattr(self, "readers", []):
            reader.join(2.0)
        for process in procs:
            if not process.is_alive():
                process.close()  # its sentinel
        for conn in (*getattr(self, "conns", []), *getattr(self, "probes", [])):
            conn.close()


class _ReplacingProcesses(_Processes):
    """:class:`_Processes` that replaces dead ranks (``Transport.replace``)."""

    def replace(self, ranks: Sequence[int], rejoin: Any) -> None:
        self.interrupted.clear()
        # Every rank's new context: the same places, a new rendezvous.
        contexts = self.host.contexts(self.nodes)
        for rank in ranks:
            old = self.procs[rank]
            old.kill()
            old.join(5.0)
            self.readers[rank].join(5.0)
            self.conns[rank].close()
            self.probes[rank].close()
            process, parent, ours = self._spawn(contexts[rank])
            self.procs[rank], self.conns[rank], self.probes[rank] = process, parent, ours
        if self.defect != "replace_forgets_rejoin":
            rejoin(contexts)
        for rank in ranks:
            self._await_ready(rank)
            self.readers[rank] = threading.Thread(target=self._read, args=(rank,), daemon=True)
            self.readers[rank].start()


class _ProcessExecutor(Executor):
    transport_cls = _Processes


class _ReplacingProcessExecutor(Executor):
    transport_cls = _ReplacingProcesses


def _processes(defect: str, base: type[_Processes] = _Processes) -> type[Executor]:
    transport = type(f"_Processes_{defect}", (base,), {"defect": defect})
    return type(f"_ProcessExecutor_{defect}", (_ProcessExecutor,), {"transport_cls": transport})


#: Broken recovery: process backends (their workers can be killed); the words the kit's
#: failure must contain.
BROKEN_RECOVERY: dict[str, tuple[type[Executor], str]] = {
    "leaves_survivors": (
        _processes("leaves_survivors"),
        "processes of an earlier incarnation still run",
    ),
    "renames_nodes": (
        _processes("renames_nodes"),
        "a recovered executor has the same ranks, local ranks and nodes",
    ),
    "replace_forgets_rejoin": (
        _processes("replace_forgets_rejoin", _ReplacingProcesses),
        "a rank replacement keeps the survivors' pids",
    ),
    "leaks_per_restart": (
        _processes("leaks_per_restart"),
        "recoveries leave the driver as one executor left it",
    ),
}

#: Broken lifecycles of a process backend, which sets no flag: the kit finds its worker
#: processes from the pids they report; the words the kit's failure must contain.
BROKEN_PROCESSES: dict[str, tuple[type[Executor], str]] = {
    "death_unreported": (
        _processes("death_unreported"),
        "a worker's death fails the call in flight",
    ),
    "worker_leaks_shm": (_processes("worker_leaks_shm"), "left behind after shutdown()"),
}

#: Broken hang bounds: process backends with a liveness probe; the words the kit's failure
#: must contain.
BROKEN_HANGS: dict[str, tuple[type[Executor], str]] = {
    "probe_blind": (
        _processes("probe_blind"),
        "a frozen rank is declared dead within about the hang bound",
    ),
    "probe_blames_busy": (
        _processes("probe_blames_busy"),
        "a long call in workers that answer the probe completes",
    ),
    "kill_forgets": (_processes("kill_forgets"), "a rank declared hung is killed"),
}
