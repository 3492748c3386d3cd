"""MultiprocExecutor: one worker process per rank on this machine."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from executor_core import (
    Executor,
    ExecutorClosedError,
    ExecutorError,
    ExecutorFailedError,
    RemoteFailure,
    RPCTimeoutError,
    WorkerContext,
    WorkerDiedError,
    WorkerError,
    dumps_method,
    method_name,
)
from executor_core import tcp_init_method as _tcp_init_method

from ._calls import CallTable, PendingCall
from ._codec import KIND_READY, KIND_STOP, DecodeError, decode, encode, encode_call
from ._doorbell import Doorbell
from ._group import WorkerGroup
from ._options import MultiprocOptions
from ._process import PARENT_DIED_EXIT, InheritedFd, SegmentLayout, WorkerSpec, worker_main
from ._ring import MAX_SLEEP_S, Ring, RingAbortedError
from ._shm import SharedSegment
from ._spin import Spinner

__all__ = ["MultiprocExecutor"]

#: Idle wait of the non-blocking pump thread between checks of its executor.
_PUMP_IDLE_S = 1.0
#: Returned by the solo fast path when another call got in first.
_CONTENDED = object()

Reply = tuple[int, int, int, bool, Any]  # kind, seq, rank, ok, value


def _decode_reply(view: memoryview) -> Reply:
    try:
        kind, ok, rank, seq, body = decode(view)
    except DecodeError as exc:  # becomes this call's error; the executor goes on
        error = WorkerError(
            exc.rank,
            "<reply>",
            type(exc.cause).__name__,
            f"the driver could not unpickle the reply of rank {exc.rank}: {exc.cause}",
            "",
            exc.cause,
        )
        return exc.kind, exc.seq, exc.rank, False, error
    if not ok and isinstance(body, RemoteFailure):
        body = body.to_error()
    return kind, seq, rank, ok, body


def _default_env(config_env: dict[str, str], rank: int, workers: int) -> dict[str, str]:
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(workers),
        "LOCAL_WORLD_SIZE": str(workers),
    }
    if "OMP_NUM_THREADS" not in config_env and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        env["OMP_NUM_THREADS"] = str(max(1, (cores or os.cpu_count() or 1) // workers))
    env.update(config_env)
    return env


def _fd_closer(fd: int) -> Callable[[], None]:
    def close() -> None:
        with contextlib.suppress(OSError):
            os.close(fd)

    return close


class MultiprocExecutor(Executor):
    """Runs one worker process per rank on this machine (backend ``"mp"``).

    Each call is written once into a shared-memory ring that every worker reads; each worker
    answers through its own shared-memory reply ring. Waits spin briefly (if configured),
    then sleep on an eventfd, so idle workers use no CPU. A monitor thread turns a worker's
    death into :class:`WorkerDiedError` for every pending and later call. See the
    distribution's README for the ``backend_options`` keys.
    """

    supports_pp = True

    # --- start-up ----------------------------------------------------------------------

    def _init_executor(self) -> None:
        config = self.config
        if config.num_nodes != 1:
            raise ExecutorError(
                f"the 'mp' backend runs on one machine, but num_nodes={config.num_nodes}; "
                "use backend='ray' for several nodes"
            )
        options = MultiprocOptions.from_backend_options(config.backend_options)
        self._options = options
        workers = config.world_size
        self._all_ranks = tuple(range(workers))
        self._default_timeout = config.rpc_timeout
        self._table = CallTable()
        self._send_lock = threading.Lock()
        self._next_seq = 1  # 0 is the ready handshake
        # The condition's lock, used directly where no wait/notify is needed: ``with`` on a
        # Condition goes through two Python-level methods, on the lock it does not (hot path).
        self._cv_lock = threading.RLock()
        self._cv = threading.Condition(self._cv_lock)
        self._leading = False
        self._leader = 0  # thread id of the last leader
        self._waiters = 0
        self._abort_error: ExecutorError | None = None
        self._closing = False
        self._pump_thread: threading.Thread | None = None
        self._group: WorkerGroup | None = None

        layout = SegmentLayout.build(
            workers, options.slots, options.slot_bytes, options.reply_slots, options.reply_bytes
        )
        segment = SharedSegment.create(layout.nbytes)
        self.add_cleanup(segment.close)
        self._segment = segment
        call_bells = [Doorbell(blocking=True) for _ in range(workers)]
        call_space = Doorbell()
        reply_bell = Doorbell(blocking=True)
        reply_spaces = [Doorbell() for _ in range(workers)]
        for bell in (*call_bells, call_space, reply_bell, *reply_spaces):
            self.add_cleanup(bell.close)
        self._reply_bell = reply_bell
        self._call_space = call_space
        spin = Spinner(options.spin_s)  # one budget for the driver's waits
        self._spinner = spin
        self._calls_ring = Ring(
            segment.buf,
            layout.broadcast,
            reader=None,
            data_bells=call_bells,
            space_bell=call_space,
            spin=spin,
        )
        self._reply_rings = [
            Ring(
                segment.buf,
                ring,
                reader=0,
                data_bells=[reply_bell],
                space_bell=reply_spaces[rank],
                spin=spin,
            )
            for rank, ring in enumerate(layout.replies)
        ]

        # Workers read the death pipe; it reaches EOF when this process dies, however it dies.
        death_r, death_w = os.pipe()
        self.add_cleanup(_fd_closer(death_w))
        ctx = multiprocessing.get_context(options.start_method)
        init_method = _tcp_init_method(config.distributed_host)
        node = socket.gethostname()
        parent_pid = os.getpid() if options.start_method != "forkserver" else None
        processes = []
        for rank in range(workers):
            context = WorkerContext(
                rank=rank,
                local_rank=rank,
                world_size=workers,
                tensor_parallel_size=config.tensor_parallel_size,
                pipeline_parallel_size=config.pipeline_parallel_size,
                distributed_init_method=init_method,
                device=config.device,
                local_world_size=workers,
                node_id=node,
                backend="mp",
            )
            spec = WorkerSpec(
                context=context,
                worker_cls=config.worker_cls,
                worker_kwargs=config.worker_kwargs,
                env=_default_env(config.env, rank, workers),
                config_env=config.env,
                segment=InheritedFd(segment.fd),
                layout=layout,
                call_bell=InheritedFd(call_bells[rank].fd),
                call_space_bell=InheritedFd(call_space.fd),
                reply_bell=InheritedFd(reply_bell.fd),
                reply_space_bell=InheritedFd(reply_spaces[rank].fd),
                death_pipe=InheritedFd(death_r),
                parent_pid=parent_pid,
                spin_s=options.spin_s,
                close_fds=(death_w,) if options.start_method == "fork" else (),
            )
            processes.append(
                ctx.Process(  # type: ignore[attr-defined]  # every context has Process
                    target=worker_main,
                    args=(spec,),
                    name=f"executor-mp-worker-{rank}",
                    daemon=True,
                )
            )
        group = WorkerGroup(processes, _death_handler(weakref.ref(self)))
        self._group = group
        self.add_cleanup(group.kill_now)
        try:
            group.start()
        finally:
            os.close(death_r)  # the children hold their copies
        self._wait_until_ready(group, options.startup_timeout)
        group.armed = True
        # A worker may have died between its handshake and arming the monitor.
        for rank in range(workers):
            code = group.exit_code(rank)
            if code is not None:
                raise _died(rank, code, "right after start-up")

    def _wait_until_ready(self, group: WorkerGroup, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = set(range(self.world_size))
        while True:
            for rank in sorted(pending):
                ring = self._reply_rings[rank]
                while ring.poll():
                    reply = ring.read(_decode_reply)
                    if reply is None or reply[0] != KIND_READY:
                        continue
                    if not reply[3]:
                        raise reply[4]
                    pending.discard(rank)
            if not pending:
                return
            for rank in sorted(pending):
                code = group.exit_code(rank)
                if code is not None and not self._reply_rings[rank].poll():
                    raise _died(rank, code, "during start-up; its stderr has the details")
            now = time.monotonic()
            if now >= deadline:
                raise ExecutorError(
                    f"worker rank(s) {sorted(pending)} did not finish init_device/load_model "
                    f"within startup_timeout={timeout:g} s (backend_options)"
                )
            # Short naps: a worker that dies before its handshake rings no doorbell.
            self._reply_bell.wait(min(deadline - now, 0.05))

    # --- failure -----------------------------------------------------------------------

    def _check_abort(self) -> None:
        if self._abort_error is not None:
            raise RingAbortedError(str(self._abort_error))

    def _abort(self, error: ExecutorError) -> None:
        """Fail every call in flight with ``error`` and wake every waiter."""
        if self._abort_error is None:
            self._abort_error = error
        for call in self._table.take_all():
            call.finish(False, error)
        with contextlib.suppress(OSError):
            self._reply_bell.ring()
            self._call_space.ring()
        with self._cv:
            self._cv.notify_all()

    def _on_worker_death(self, rank: int, exitcode: int) -> None:
        """Monitor thread: a worker ended while the executor was running."""
        error = _died(rank, exitcode, "")
        # Failed state first, so that whoever sees the error also sees is_failed.
        self.fail(error)
        self._abort(error)
        if self._group is not None:
            self._group.terminate(self._options.shutdown_grace_s)

    # --- calls -------------------------------------------------------------------------

    def collective_rpc(  # type: ignore[override]  # one implementation for both overloads
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> list[Any] | Future[list[Any]]:
        try:
            return self._collective_rpc(method, timeout, args, kwargs, non_block, unique_reply_rank)
        except BaseException:
            self._check_rings()
            raise

    def _check_rings(self) -> None:
        """After an interrupted call: fail the executor if a ring was left mid-message."""
        if self._calls_ring.broken or any(ring.broken for ring in self._reply_rings):
            error = ExecutorFailedError(
                "a call was interrupted half-way through a transfer that spans several ring "
                "slots, so the rings are out of step; shut this executor down and create a new one"
            )
            self.fail(error)
            self._abort(error)

    def _collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        non_block: bool,
        unique_reply_rank: int | None,
    ) -> list[Any] | Future[list[Any]]:
        if self._closed or self._failure is not None:
            self.check_open()
        if timeout is not None or self._default_timeout is not None:
            timeout = self.resolve_timeout(timeout)
        wire: str | bytes
        if type(method) is str:
            name = wire = method
        else:
            name, wire = method_name(method), dumps_method(method)
        if unique_reply_rank is None:
            reply_rank, expected = -1, self._all_ranks
        else:
            self.check_reply_rank(unique_reply_rank)
            reply_rank, expected = unique_reply_rank, (unique_reply_rank,)
        if not non_block and not self._leading and not len(self._table) and self._try_lead():
            try:
                solo = self._solo_call(name, wire, args, kwargs, reply_rank, expected, timeout)
            finally:
                self._release_lead()
            if solo is not _CONTENDED:
                return solo  # type: ignore[no-any-return]  # the result list
        with self._send_lock:
            if self._closed or self._failure is not None:
                self.check_open()
            seq = self._next_seq
            parts, nbytes = encode_call(reply_rank, seq, wire, args, kwargs)
            call = PendingCall(seq, name, expected, non_block, timeout)
            self._next_seq = seq + 1
            self._table.add(call)
            try:
                sent = self._calls_ring.write(parts, nbytes, call.deadline, self._while_sending)
            except RingAbortedError:
                self._table.remove(call)
                raise self._abort_error or ExecutorClosedError("executor closed") from None
            except BaseException:
                self._finish_ready(self._table.remove(call))
                raise
            if not sent:
                self._finish_ready(self._table.remove(call))
                raise RPCTimeoutError(name, list(range(self.world_size)), timeout or 0.0)
        if call.future is not None:
            self._ensure_pump()
            return call.future
        return self._await(call)

    def _solo_call(
        self,
        name: str,
        wire: str | bytes,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        reply_rank: int,
        expected: tuple[int, ...],
        timeout: float | None,
    ) -> Any:
        """The fast path of a blocking call made while no other call is in flight: the
        caller, already the leader, reads its replies straight from the rings (no call
        table, no future). Same semantics as the general path. Returns ``_CONTENDED`` if
        another thread got a call in first."""
        with self._send_lock:
            if self._closed or self._failure is not None:
                self.check_open()
            if len(self._table):
                return _CONTENDED
            seq = self._next_seq
            parts, nbytes = encode_call(reply_rank, seq, wire, args, kwargs)
            self._next_seq = seq + 1
            deadline = None if timeout is None else time.monotonic() + timeout
            try:
                sent = self._calls_ring.write(parts, nbytes, deadline, self._drain_while_sending)
            except RingAbortedError:
                raise self._abort_error or ExecutorClosedError("executor closed") from None
            if not sent:
                raise RPCTimeoutError(name, list(self._all_ranks), timeout or 0.0)
        results: dict[int, Any] = {}
        error: Any = None
        later: list[Reply] = []  # replies to calls sent after this one: dispatched after it
        rings = self._reply_rings
        bell = self._reply_bell
        spinner = self._spinner
        spin_until = -1.0  # not started
        try:
            while True:
                got = False
                for ring in rings:
                    while (reply := ring.try_read(_decode_reply)) is not None:
                        got = True
                        _kind, reply_seq, rank, ok, value = reply
                        if reply_seq != seq:
                            if reply_seq > seq:
                                later.append(reply)
                            continue  # older: a late reply to a call that timed out
                        if ok:
                            if rank in expected:
                                results[rank] = value
                        elif rank in expected:
                            if error is None or getattr(error, "rank", rank) > rank:
                                error = value
                            results[rank] = None
                        else:  # a rank that answers only when it fails
                            error = value
                            results.update(dict.fromkeys(expected))
                if len(results) == len(expected):
                    break
                if got:
                    continue
                self._check_abort()
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    missing = [r for r in expected if r not in results]
                    raise RPCTimeoutError(name, missing, timeout or 0.0)
                if spin_until < 0.0:
                    spin_until = spinner.start()
                if now < spin_until and spinner.pause():
                    continue
                spin_until = 0.0
                bell.wait(None if deadline is None else deadline - now)
        except RingAbortedError:
            raise self._abort_error or ExecutorClosedError("executor closed") from None
        finally:
            for reply in later:
                self._dispatch(reply)
        if error is not None:
            raise error
        return [results[r] for r in expected]

    def _drain_while_sending(self) -> None:
        """The solo caller (already the leader) waits for a free slot: keep replies flowing."""
        self._check_abort()
        self._drain()

    def _while_sending(self) -> None:
        """Called while the writer waits for a free slot: drain replies if nobody is, so a
        worker blocked on a full reply ring can go on and free its slot."""
        self._check_abort()
        if self._is_leader():
            self._drain()  # a future's callback, run by the leader, is sending a call
            return
        if not self._try_lead():
            return
        try:
            self._drain()
        finally:
            self._release_lead()

    def _is_leader(self) -> bool:
        """True in the thread that reads replies now (e.g. inside a future's callback)."""
        return self._leading and self._leader == threading.get_ident()

    def _try_lead(self) -> bool:
        """Become the thread that reads replies, if no other thread is."""
        with self._cv_lock:
            if self._leading:
                return False
            self._leading = True
            self._leader = threading.get_ident()
            return True

    def _release_lead(self) -> None:
        with self._cv_lock:
            self._leading = False
            if self._waiters:
                self._cv.notify_all()

    def _await(self, call: PendingCall) -> list[Any]:
        deadline = call.deadline
        try:
            while not call.done:
                if self._is_leader():
                    # Called from a future's callback by the leader itself: pump here.
                    self._pump(call, deadline)
                elif self._try_lead():
                    try:
                        self._pump(call, deadline)
                    finally:
                        self._release_lead()
                else:
                    with self._cv:
                        if self._leading and not call.done:
                            self._waiters += 1
                            try:
                                self._cv.wait(_nap(deadline))
                            finally:
                                self._waiters -= 1
                if not call.done and deadline is not None and time.monotonic() >= deadline:
                    self._finish_ready(self._table.remove(call))
                    if not call.done:
                        raise RPCTimeoutError(call.method, call.missing(), call.timeout or 0.0)
        except BaseException:
            if not call.done:
                self._finish_ready(self._table.remove(call))
            raise
        return call.outcome()

    def _drain(self) -> bool:
        """Dispatch every reply already waiting, without blocking. True if there was one."""
        got = False
        for ring in self._reply_rings:
            while (reply := ring.try_read(_decode_reply)) is not None:
                self._dispatch(reply)
                got = True
        return got

    def _pump(self, call: PendingCall | None, deadline: float | None) -> None:
        """As the leader: dispatch replies until ``call`` is done (or, for None, until no
        non-blocking call is pending or a blocking caller waits), or ``deadline``."""
        bell = self._reply_bell
        table = self._table
        spinner = self._spinner
        spin_until = -1.0  # not started
        try:
            while True:
                if call is not None:
                    if call.done:
                        return
                elif table.non_blocking == 0 or self._waiters:
                    return
                self._check_abort()
                if self._drain():
                    continue
                if not len(table):
                    return
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return
                if spin_until < 0.0:
                    spin_until = spinner.start()
                if now < spin_until and spinner.pause():
                    continue  # a reply is often only microseconds away
                spin_until = 0.0
                # Replies, failure and shutdown all ring this doorbell: no timeout is needed
                # unless the caller has a deadline.
                bell.wait(None if deadline is None else deadline - now)
        except RingAbortedError:
            return

    def _dispatch(self, reply: Reply | None) -> None:
        if reply is None:
            return
        _kind, seq, rank, ok, value = reply
        self._finish_ready(self._table.on_reply(seq, rank, ok, value))

    def _finish_ready(self, calls: list[PendingCall]) -> None:
        for call in calls:
            call.finish_from_replies()
        if calls and self._waiters:
            with self._cv:
                self._cv.notify_all()

    # --- non-blocking calls: a pump thread reads replies when no caller is waiting ------

    def _ensure_pump(self) -> None:
        with self._cv:
            if self._pump_thread is None:
                thread = threading.Thread(
                    target=_pump_loop,
                    args=(weakref.ref(self),),
                    name="executor-mp-replies",
                    daemon=True,
                )
                self._pump_thread = thread
                thread.start()
            elif self._waiters:
                self._cv.notify_all()

    def _pump_step(self) -> bool:
        """One bounded round of the pump thread. False when it should exit."""
        table = self._table
        if self._closing or self._abort_error is not None:
            return False
        if table.non_blocking == 0 or not self._try_lead():
            with self._cv:
                self._waiters += 1
                try:
                    self._cv.wait(_PUMP_IDLE_S if table.non_blocking == 0 else MAX_SLEEP_S)
                finally:
                    self._waiters -= 1
            return True
        try:
            self._pump(None, time.monotonic() + MAX_SLEEP_S)
        finally:
            self._release_lead()
        for call in table.expired(time.monotonic()):
            self._finish_ready(table.remove(call))
            call.finish(False, RPCTimeoutError(call.method, call.missing(), call.timeout or 0.0))
        return True

    # --- shutdown ----------------------------------------------------------------------

    def _shutdown_workers(self) -> None:
        group = getattr(self, "_group", None)
        if group is None or self._closing:
            return
        self._closing = True
        group.closing = True
        options = self._options
        if not group.armed:  # start-up failed: nothing to wait for
            group.kill_now()
        elif self._abort_error is None and self._send_lock.acquire(
            timeout=options.shutdown_grace_s
        ):
            try:
                parts, nbytes = encode(KIND_STOP, True, -1, 0, None)
                deadline = time.monotonic() + options.shutdown_grace_s
                self._calls_ring.write(parts, nbytes, deadline, self._check_abort)
            except RingAbortedError:
                pass
            finally:
                self._send_lock.release()
        group.stop(options.shutdown_grace_s, options.shutdown_grace_s)
        self._abort(ExecutorClosedError("the executor was shut down while this call was running"))
        pump = self._pump_thread
        if pump is not None and pump is not threading.current_thread():
            pump.join(_PUMP_IDLE_S + 1.0)
        # Let callers in other threads leave the rings before the cleanups unmap them.
        if self._send_lock.acquire(timeout=2.0):
            self._send_lock.release()
        if not self._is_leader():  # not called back by the leader itself
            with self._cv:
                self._cv.wait_for(lambda: not self._leading, timeout=2.0)


def _nap(deadline: float | None) -> float:
    if deadline is None:
        return MAX_SLEEP_S
    return max(0.0, min(MAX_SLEEP_S, deadline - time.monotonic()))


def _died(rank: int, exitcode: int, when: str) -> WorkerDiedError:
    detail = when
    if exitcode == PARENT_DIED_EXIT:
        detail = ", ".join(filter(None, [when, "it saw its driver die"]))
    if exitcode < 0:
        return WorkerDiedError(rank, signal=-exitcode, detail=detail)
    return WorkerDiedError(rank, exitcode=exitcode, detail=detail)


def _death_handler(ref: weakref.ref[MultiprocExecutor]) -> Callable[[int, int], None]:
    def on_death(rank: int, exitcode: int) -> None:
        executor = ref()
        if executor is not None:
            executor._on_worker_death(rank, exitcode)

    return on_death


def _pump_loop(ref: weakref.ref[MultiprocExecutor]) -> None:
    while True:
        executor = ref()
        if executor is None or not executor._pump_step():
            return
        del executor  # hold no reference between rounds: the executor may be collected
