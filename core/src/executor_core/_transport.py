"""The backend contract: a :class:`Transport` (launcher and carrier of calls) plugged into a
:class:`TransportHost` (the core's side, which owns every rule of a call).

A transport never sees the executor: it gets the host, which holds the calls in flight, the
failure state and the cleanups, and nothing that references the executor. So an executor
dropped without ``shutdown()`` is collected whatever the transport's threads hold, and its
finalizer stops the transport.
"""

from __future__ import annotations

import abc
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from ._calls import Call, CallTable
from ._config import worker_environment
from ._errors import ExecutorClosedError, ExecutorError, ExecutorFailedError, RPCTimeoutError
from ._net import tcp_init_method
from ._worker import WorkerContext
from ._wrapper import WorkerWrapper

if TYPE_CHECKING:
    import pluggy

    from ._config import ExecutorConfig

__all__ = ["Transport", "TransportHost"]

#: Longest single wait of a reply reader or a waiting caller: between slices it looks again
#: at its deadline and at the executor's state, so that no wait depends on one wake-up alone.
_SLICE_S = 1.0
#: Longest single read of the thread that completes non-blocking calls, so that blocking
#: callers soon take over reading their own replies.
_PUMP_SLICE_S = 0.05
#: How long shutdown waits for a thread still reading replies to leave the transport before
#: the cleanups release what it reads from.
_LEAVE_S = 2.0


def _log_exception(message: str, *args: object) -> None:
    import logging  # deferred: only needed on this error path

    logging.getLogger("executor_core").exception(message, *args)


class Transport(abc.ABC):
    """What a backend supplies: how workers start and stop, how a call reaches every rank, and
    how replies and deaths come back. Everything else (validation, ordering, timeouts, reply
    gathering, failure, shutdown, cleanup) is the core's.

    Implement :meth:`start`, :meth:`send` and :meth:`close`. Replies reach the core in one of
    two ways: the transport calls :meth:`TransportHost.deliver` from threads of its own
    (``polls = False``, the default), or the core calls :meth:`poll` from the threads that
    wait for replies (``polls = True``: no extra thread hop per call; the core lets one
    thread poll at a time). A transport never holds the executor; :attr:`host` is all it
    needs.
    """

    #: True if replies are read by the core calling :meth:`poll`; False if the transport
    #: delivers them itself.
    polls: ClassVar[bool] = False

    def __init__(self, host: TransportHost) -> None:
        #: The core's side: config, worker contexts and wrappers, deliver, worker_died.
        self.host = host

    @abc.abstractmethod
    def start(self) -> None:
        """Start every worker and return once each has run ``init_device`` and ``load_model``.

        Raise on failure (a worker's error as :class:`~executor_core.WorkerError` naming its
        rank); the core then calls :meth:`close` and the cleanups.
        """

    @abc.abstractmethod
    def send(self, call: Call) -> bool:
        """Deliver ``call`` to every rank. The core calls it from one thread at a time, in
        sequence order; every rank must run calls in the order they were sent.

        May block (a full queue) until ``call.deadline``; return False if that passed before
        the call could be sent. After :meth:`interrupt`, return (or raise) promptly.
        """

    @property
    def ranks(self) -> tuple[int, ...] | None:
        """The ranks this transport drives, once started: ``None`` (the default) for every
        rank. A transport that drives only this process's own rank (SPMD under an external
        launcher) names it; calls then expect a reply from it alone."""
        return None

    def inline_runner(self) -> Callable[..., Any] | None:
        """For a transport that drives one rank in the caller's own process: a function
        ``run(method, args, kwargs)`` that runs a call on it in the calling thread and returns
        its result or raises the worker's exception (the core makes that a ``WorkerError``).
        The core then makes a blocking call without a timeout, while no other call is in
        flight, a plain method call. Asked once, after :meth:`start`; None (the default):
        every call goes through :meth:`send`."""
        return None

    def poll(self, timeout: float | None) -> None:
        """Deliver the replies that are ready; if there are none, wait up to ``timeout``
        seconds (``None``: until one arrives) for one. Only for ``polls = True``; the core
        calls it from one thread at a time. Return promptly after :meth:`interrupt`."""
        raise NotImplementedError(f"{type(self).__name__} sets polls = True but has no poll()")

    def interrupt(self) -> None:  # noqa: B027 - optional: transports that never block need none
        """The executor failed or is closing: wake any thread blocked in :meth:`send` or
        :meth:`poll`. Called at most once, from any thread."""

    @abc.abstractmethod
    def close(self, graceful: bool) -> None:
        """Stop the workers; called once by the core. ``graceful``: let each finish its calls
        and run its worker's ``shutdown`` (and the stopping hook), waiting a bounded time, then
        stop what is left by force. Not graceful (after a failure, or from the finalizer):
        stop by force at once. Never block for ever; release memory, sockets and files through
        :meth:`TransportHost.add_cleanup` so that they are released after readers have left.
        """


class _Cleanups:
    """Resource releasers that run once, last in first out, from shutdown or the finalizer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []

    def add(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._callbacks.append(callback)

    def run(self) -> None:
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
        errors: list[BaseException] = []
        for callback in reversed(callbacks):
            try:
                callback()
            except Exception as exc:  # noqa: BLE001 - run every releaser (each is logged), then report
                _log_exception("executor cleanup %r failed", callback)
                errors.append(exc)
        if errors:
            raise ExecutorError(f"{len(errors)} cleanup step(s) failed") from errors[0]


class TransportHost:
    """The core's side of a transport: one per executor, and never holding the executor.

    Transports use :attr:`config`, :attr:`name`, :meth:`contexts` and :meth:`wrapper` to
    start workers, :meth:`deliver` and :meth:`worker_died` to report, :meth:`add_cleanup` for
    what must be released, and :meth:`while_blocked` while a send waits for room.
    """

    def __init__(
        self,
        config: ExecutorConfig,
        name: str,
        hooks: pluggy.HookRelay | None,
    ) -> None:
        #: The executor's configuration.
        self.config = config
        #: The backend's name, as workers see it in ``WorkerContext.backend``.
        self.name = name
        self._hooks = hooks
        self.state_lock = threading.Lock()
        #: Set once :meth:`Executor.shutdown` has begun.
        self.closed = False
        self.failure: ExecutorFailedError | None = None
        self.failure_callbacks: list[Callable[[ExecutorFailedError], None]] = []
        self.table = CallTable()
        #: Held while a call takes its sequence number and is sent: one order for every rank.
        self.send_lock = threading.Lock()
        # The hot path: a reply goes straight to the table (one call frame less per reply).
        self.deliver = self.table.deliver  # type: ignore[method-assign]  # same signature
        self.cleanups = _Cleanups()
        self.transport: Transport | None = None
        self._lead_lock = threading.Lock()
        self._leader = 0  # thread id of the thread reading replies, 0 when none
        self._pump: threading.Thread | None = None
        self._pump_wake = threading.Event()
        self.released = False
        #: What every worker's environment gets (see ``worker_environment``), fixed when the
        #: executor is created.
        self.worker_env = worker_environment(config, os.environ)
        # What that replaces in this process: an in-process worker applies it to the driver's
        # environment, and release puts it back (see _restore_env).
        self._saved_env = {key: os.environ.get(key) for key in self.worker_env}

    # --- for transports: starting workers ----------------------------------------------

    def context(
        self,
        rank: int,
        *,
        local_rank: int,
        local_world_size: int,
        node_id: str,
        init_method: str,
    ) -> WorkerContext:
        """The :class:`WorkerContext` of ``rank``; the config's fields and :attr:`name` are
        filled in here."""
        config = self.config
        return WorkerContext(
            rank=rank,
            local_rank=local_rank,
            world_size=config.world_size,
            tensor_parallel_size=config.tensor_parallel_size,
            pipeline_parallel_size=config.pipeline_parallel_size,
            distributed_init_method=init_method,
            device=config.device,
            local_world_size=local_world_size,
            node_id=node_id,
            backend=self.name,
        )

    def contexts(
        self, node_ids: Sequence[str] | None = None, init_method: str | None = None
    ) -> list[WorkerContext]:
        """Every rank's context, in rank order. ``node_ids[rank]`` names each rank's node
        (default: every rank on this host); local ranks count up per node in rank order.
        ``init_method`` defaults to a free port on ``config.distributed_host``."""
        world_size = self.config.world_size
        if node_ids is None:
            node_ids = [socket.gethostname()] * world_size
        if len(node_ids) != world_size:
            raise ValueError(f"node_ids has {len(node_ids)} entries for {world_size} ranks")
        if init_method is None:
            init_method = tcp_init_method(self.config.distributed_host)
        per_node: dict[str, int] = {}
        local_ranks = []
        for node in node_ids:
            local_ranks.append(per_node.get(node, 0))
            per_node[node] = local_ranks[-1] + 1
        return [
            self.context(
                rank,
                local_rank=local_ranks[rank],
                local_world_size=per_node[node],
                node_id=node,
                init_method=init_method,
            )
            for rank, node in enumerate(node_ids)
        ]

    def wrapper(self, context: WorkerContext) -> WorkerWrapper:
        """The wrapper that hosts ``context``'s worker: in this process as it is (with this
        registry's hooks), or pickled to the worker's process (which loads its own hooks)."""
        config = self.config
        return WorkerWrapper(
            config.worker_cls, config.worker_kwargs, context, env=self.worker_env, hooks=self._hooks
        )

    def add_cleanup(self, callback: Callable[[], None]) -> None:
        """Register a releaser, run once after the workers stopped and every reader left (last
        in, first out), at shutdown or by the finalizer. It must not reference the executor."""
        self.cleanups.add(callback)

    # --- for transports: reporting -----------------------------------------------------

    def deliver(self, seq: int, rank: int, ok: bool, value: Any) -> None:
        """``rank``'s reply to call ``seq``: ``ok`` with the result, or not with the failure (a
        :class:`~executor_core.RemoteFailure` or an exception). Thread-safe."""
        self.table.deliver(seq, rank, ok, value)

    def worker_died(self, error: ExecutorFailedError) -> None:
        """A worker (or the transport itself) is gone for good: the executor fails with
        ``error`` (typically :class:`~executor_core.WorkerDiedError`), every call in flight
        raises it, and the failure callbacks run once. Thread-safe; later reports are
        ignored."""
        self.fail(error)

    def fail(self, error: ExecutorFailedError) -> bool:
        """Mark the executor failed with ``error`` (once): fail the calls in flight, interrupt
        the transport, run the failure callbacks. False if it had failed or closed already."""
        with self.state_lock:
            if self.failure is not None or self.closed:
                return False
            self.failure = error  # first, so that whoever sees the error sees is_failed too
            callbacks, self.failure_callbacks = self.failure_callbacks, []
        self.abort(error)
        for callback in callbacks:
            run_callback(callback, error)
        return True

    @property
    def closed_error(self) -> ExecutorError | None:
        """The error calls fail with once the executor failed or is closing, else None."""
        return self.table.closed_error

    def while_blocked(self, timeout: float = 0.0) -> bool:
        """Call while :meth:`Transport.send` waits for room (a full queue, earlier calls to
        drain): if no other thread reads replies, read them here, waiting up to ``timeout``
        for one (a worker blocked on a full reply queue can then go on and free room).
        Returns True if it read, False if another thread reads replies (then wait on your
        own condition, at most ``timeout``)."""
        transport = self.transport
        if transport is None or not transport.polls:
            return False
        if self._leader == threading.get_ident():
            transport.poll(timeout)
            return True
        if not self._try_lead():
            return False
        try:
            transport.poll(timeout)
        finally:
            self._release_lead()
        return True

    # --- for the executor: waiting for replies -------------------------------------------

    def _try_lead(self) -> bool:
        with self._lead_lock:
            if self._leader:
                return False
            self._leader = threading.get_ident()
            return True

    def _release_lead(self) -> None:
        self._leader = 0
        table = self.table
        if table.waiters:
            with table.lock:
                table.cond.notify_all()

    def wait(self, call: Call, transport: Transport) -> list[Any]:
        """Wait for ``call`` (a blocking caller); raise its error or RPCTimeoutError.

        With a polling transport the waiting threads take turns reading replies: one reads
        (the leader) while the others wait on the table's condition until their call is done
        or the leader leaves. The common case, one caller, is one lead and one poll."""
        table = self.table
        deadline = call.deadline
        polls = transport.polls
        try:
            while not call.done:
                # Read replies here if this thread already reads them (a future's callback,
                # run by the reader, made this call) or if nobody does.
                nested = polls and self._leader == threading.get_ident()
                if nested or (polls and self._try_lead()):
                    try:
                        poll = transport.poll
                        while not call.done and table.closed_error is None:
                            if deadline is None:
                                poll(_SLICE_S)
                                continue
                            remaining = deadline - time.monotonic()
                            if remaining <= 0:
                                break
                            poll(min(remaining, _SLICE_S))
                    finally:
                        if not nested:
                            self._release_lead()
                else:
                    with table.lock:
                        if not call.done and not (polls and not self._leader):
                            table.waiters += 1
                            try:
                                table.cond.wait(_slice(deadline))
                            finally:
                                table.waiters -= 1
                if not call.done and deadline is not None and time.monotonic() >= deadline:
                    table.remove(call)
                    if not call.done:
                        raise RPCTimeoutError(call.name, call.missing(), call.timeout or 0.0)
        except BaseException:
            if not call.done:
                table.remove(call)
            raise
        return call.outcome()

    # --- non-blocking calls: a thread reads replies and expires deadlines ---------------

    def ensure_pump(self, call: Call) -> None:
        """A non-blocking call was sent: make sure a thread completes it. With a polling
        transport that thread reads replies when no blocking caller does; with any transport
        it fails calls whose deadline passes. A transport that delivers replies itself needs
        no thread for a call without a deadline."""
        transport = self.transport
        if transport is None or (not transport.polls and call.deadline is None):
            return
        if self._pump is not None:
            self._pump_wake.set()
            if transport.polls and self.table.waiters:
                with self.table.lock:
                    self.table.cond.notify_all()
            return
        with self._lead_lock:
            if self._pump is None:
                thread = threading.Thread(
                    target=self._pump_loop, name="executor-calls", daemon=True
                )
                self._pump = thread
                thread.start()

    def _pump_loop(self) -> None:
        # Holds the host (never the executor): the finalizer closes the table, which ends it.
        table = self.table
        transport = self.transport
        assert transport is not None
        wake = self._pump_wake
        while table.closed_error is None:
            if not table.non_blocking:
                # Idle: its own event, not the table's condition, so that blocking calls do
                # not wake it (ensure_pump and abort set it).
                wake.wait(_SLICE_S)
                wake.clear()
                continue
            deadline = self._next_deadline()
            wait_s = _PUMP_SLICE_S if transport.polls else _SLICE_S
            if deadline is not None:
                wait_s = max(0.0, min(wait_s, deadline - time.monotonic()))
            if transport.polls and not table.waiters and self._try_lead():
                try:
                    # Short slices: blocking callers take over between them (they read their
                    # own replies).
                    transport.poll(wait_s)
                finally:
                    self._release_lead()
            elif transport.polls:
                with table.lock:  # woken when the reader leaves or a call completes
                    if table.closed_error is None:
                        table.waiters += 1
                        try:
                            table.cond.wait(wait_s)
                        finally:
                            table.waiters -= 1
            else:
                wake.wait(wait_s)  # only deadlines to watch: the transport delivers replies
                wake.clear()
            now = time.monotonic()
            for call in table.expired(now):
                table.remove(call)
                call.finish(False, RPCTimeoutError(call.name, call.missing(), call.timeout or 0.0))

    def _next_deadline(self) -> float | None:
        expired = self.table.expired(float("inf"))
        deadlines = [c.deadline for c in expired if c.deadline is not None]
        return min(deadlines) if deadlines else None

    # --- for the executor: failure and release ---------------------------------------------

    def abort(self, error: ExecutorError) -> None:
        """Fail every call in flight with ``error`` and wake whatever the transport blocks."""
        if self.table.close(error):
            self._pump_wake.set()
            transport = self.transport
            if transport is not None:
                try:
                    transport.interrupt()
                except Exception:  # noqa: BLE001 - logged; the release goes on
                    _log_exception("interrupting the transport failed")

    def release(self, graceful: bool) -> None:
        """Stop the transport, fail what is left in flight, wait for readers to leave, run the
        cleanups. Once; the finalizer calls it with ``graceful=False``."""
        if self.released:
            return
        self.released = True
        transport = self.transport
        try:
            if transport is not None:
                try:
                    transport.close(graceful)
                finally:
                    self.abort(ExecutorClosedError("the executor was shut down during the call"))
            else:
                self.abort(ExecutorClosedError("the executor was shut down during the call"))
            # Let senders and readers leave the transport before the cleanups release what
            # they use (a graceful release already holds the send lock).
            if not graceful and self.send_lock.acquire(timeout=_LEAVE_S):
                self.send_lock.release()
            give_up = time.monotonic() + _LEAVE_S
            while self._leader and self._leader != threading.get_ident():
                if time.monotonic() >= give_up:
                    break
                time.sleep(0.001)
            pump = self._pump
            if pump is not None and pump is not threading.current_thread():
                pump.join(_LEAVE_S)
        finally:
            self._restore_env()
            self.cleanups.run()

    def _restore_env(self) -> None:
        """Undo what an in-process worker's environment did to this process's (a key the
        user set to something else since is left alone)."""
        for key, value in self.worker_env.items():
            if os.environ.get(key) != value:
                continue
            saved = self._saved_env[key]
            if saved is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = saved


def run_callback(
    callback: Callable[[ExecutorFailedError], None], error: ExecutorFailedError
) -> None:
    """Run one failure callback; one that raises is logged and does not stop the others."""
    try:
        callback(error)
    except Exception:  # noqa: BLE001 - one bad callback must not stop the others; logged
        _log_exception("executor failure callback %r raised", callback)


def _slice(deadline: float | None) -> float:
    if deadline is None:
        return _SLICE_S
    return max(0.0, min(_SLICE_S, deadline - time.monotonic()))


def release_host(host: TransportHost) -> None:
    """The executor's finalizer: stop by force what a dropped executor left running."""
    host.release(graceful=False)
