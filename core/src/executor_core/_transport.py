"""The backend contract: the :class:`Transport` a backend implements, and the
:class:`TransportHost`, all a transport sees of the core.

A transport is a launcher and a carrier of calls; every rule of a call is the core's. It gets
a host, never the executor: the executor's finalizer holds the host's recovery alone, so an
executor dropped without ``shutdown()`` is collected whatever the transport's threads hold,
and its workers are still stopped.
"""

from __future__ import annotations

import abc
import os
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from ._calls import Call, CallTable, Replies
from ._config import ExecutorConfig, worker_environment
from ._errors import (
    ExecutorClosedError,
    ExecutorError,
    ExecutorFailedError,
    WorkerDiedError,
    WorkerError,
)
from ._net import release_port, reserve_port, tcp_init_method
from ._worker import WorkerContext
from ._wrapper import WorkerWrapper

if TYPE_CHECKING:
    import pluggy

    from ._recovery import HangWatch, Recovery

__all__ = ["Transport", "TransportHost", "log_exception", "run_logged"]

#: How long a release waits for a thread still sending or reading replies to leave.
_LEAVE_S = 2.0
#: A failed call whose other ranks ran it silently: how long their liveness probe may take,
#: and, if one does not answer, how long the core waits for its death to be reported.
_CONFIRM_PROBE_S = 1.0
_DEATH_REPORT_S = 2.0


def log_exception(message: str) -> None:
    """Log the exception being handled, on the ``executor_core`` logger."""
    import logging  # deferred: only needed on error paths

    logging.getLogger("executor_core").exception(message)


def run_logged(what: str, function: Callable[..., Any], *args: Any) -> None:
    """``function(*args)``; an exception is logged (naming ``what``) and goes no further."""
    try:
        function(*args)
    except Exception:  # noqa: BLE001 - one failing step must not stop the others; logged
        log_exception(f"{what} failed")


class Transport(abc.ABC):
    """What a backend supplies: how workers start and stop, how a call reaches every rank,
    and how replies and deaths come back. Everything else (validation, ordering, timeouts,
    reply gathering, failure, shutdown, cleanup) is the core's.

    Implement :meth:`start`, :meth:`send` and :meth:`close`. Replies reach the core in one of
    two ways: the transport calls :attr:`TransportHost.deliver` from threads of its own
    (``polls = False``), or the core calls :meth:`poll` from the threads that wait for
    replies (``polls = True``, one at a time: no extra thread hop per call).
    """

    #: True if replies are read by the core calling :meth:`poll`.
    polls: ClassVar[bool] = False

    def __init__(self, host: TransportHost) -> None:
        #: The core's side: config, contexts and wrappers, deliver, worker_died, cleanups.
        self.host = host

    @abc.abstractmethod
    def start(self) -> None:
        """Start every worker and return once each has run ``init_device`` and ``load_model``.
        Raise on failure (a worker's error as :class:`~executor_core.WorkerError` naming its
        rank); the core then calls :meth:`close` and the cleanups."""

    @abc.abstractmethod
    def send(self, call: Call) -> bool:
        """Deliver ``call`` to every rank, which must run calls in the order they were sent
        (the core calls it from one thread at a time, in sequence order). May block (a full
        queue) until ``call.deadline``; return False if that passed before the call could be
        sent, and then no rank may run it (one sent in part is withdrawn from every rank), as
        after an exception. After :meth:`interrupt`, return (or raise) promptly."""

    @abc.abstractmethod
    def close(self, graceful: bool) -> None:
        """Stop the workers; called once. ``graceful``: let each finish its calls and run its
        worker's ``shutdown``, waiting a bounded time, then stop what is left by force. Not
        graceful (after a failure, or from the finalizer): by force at once. Never block for
        ever; release memory, sockets and files through :meth:`TransportHost.add_cleanup`,
        which runs them after readers have left."""

    @property
    def ranks(self) -> tuple[int, ...] | None:
        """The ranks this transport drives: ``None`` (the default) for every rank; a transport
        that drives only this process's own rank (SPMD under an external launcher) names it."""
        return None

    def inline_runner(self) -> Callable[..., Any] | None:
        """For a transport that drives one rank in the caller's process: ``run(method, args,
        kwargs)``, which runs a call in the calling thread (the core then makes a blocking
        call without a timeout, with nothing else in flight, a plain method call). Asked once,
        after :meth:`start`; None (the default): every call goes through :meth:`send`."""
        return None

    def poll(self, timeout: float | None) -> None:
        """Deliver the replies that are ready, or wait up to ``timeout`` seconds for one. Only
        for ``polls = True``. Return promptly after :meth:`interrupt`."""
        raise NotImplementedError(f"{type(self).__name__} sets polls = True but has no poll()")

    def interrupt(self) -> None:  # noqa: B027 - optional: transports that never block need none
        """The executor failed or is closing: wake any thread blocked in :meth:`send`,
        :meth:`poll` or a start. Called at most once, from any thread."""

    def probe(self, ranks: Sequence[int], timeout: float) -> set[int]:
        """The liveness probe (``Capabilities(liveness_probe=True)``): ask each rank's process,
        on a thread other than the one running calls, whether it still answers; return the
        ranks that did not within ``timeout`` seconds (a dead one included). A process busy in
        a long call or in a collective that released the interpreter answers; a stopped or
        frozen one does not."""
        raise NotImplementedError(f"{type(self).__name__} declares no liveness probe")

    def kill(self, ranks: Sequence[int]) -> None:
        """End the processes of ``ranks`` at once (the core declared them hung and failed the
        calls in flight already). Only with :meth:`probe`."""
        raise NotImplementedError(f"{type(self).__name__} declares no liveness probe")

    def replace(
        self, ranks: Sequence[int], rejoin: Callable[[Sequence[WorkerContext]], None]
    ) -> None:
        """Rank replacement (``Capabilities(recovery="replace")``): new processes for the dead
        ``ranks`` while every other rank keeps its process and memory. Called from the
        recovery thread; :attr:`host` is a fresh host already (rebind what held the old one,
        and undo :meth:`interrupt`). Make every rank's new context (the same places, a new
        rendezvous), start the new ranks' processes with theirs, reading calls from the next
        one sent, then call ``rejoin(contexts)``: the core sends the rejoin call (survivors run
        ``WorkerBase.rejoin`` once they finished the calls they held) and the survivors'
        ``rejoin_timeout_s`` starts. Then wait, as :meth:`start` does, until the new ranks are
        ready, handing other replies to :attr:`TransportHost.deliver`, and end the wait
        promptly after :meth:`interrupt`. Raise if it cannot be done (the core restarts every
        rank); raise :class:`~executor_core.NodeLostError` if a node the ranks need is gone
        for good (the core fails the executor at once), from :meth:`start` too."""
        raise NotImplementedError(f"{type(self).__name__} cannot replace ranks")

    @classmethod
    def can_probe(cls) -> bool:
        """Whether this transport implements :meth:`probe`."""
        return cls.probe is not Transport.probe

    @classmethod
    def can_replace(cls) -> bool:
        """Whether this transport implements :meth:`replace`."""
        return cls.replace is not Transport.replace


class TransportHost:
    """The core's side of one transport: all a transport may reach.

    For transports, these members and no others: :attr:`config`, :attr:`name`,
    :attr:`worker_env`, :meth:`context`, :meth:`contexts`, :meth:`wrapper` and
    :meth:`rendezvous` to start workers; :attr:`deliver`, :meth:`worker_died` and
    :meth:`while_blocked` while they run; :attr:`closed_error`; :meth:`add_cleanup`,
    :meth:`keep`, :meth:`take` and :attr:`restarting` for what outlives them. The rest is the
    core's own: a new host per incarnation of the workers (each recovery), holding the calls
    in flight, the failure and the cleanups, and never the executor.
    """

    def __init__(
        self,
        config: ExecutorConfig,
        name: str,
        hooks: pluggy.HookRelay | None,
        recovery: Recovery | None = None,
    ) -> None:
        #: The executor's configuration, and the backend's name (``WorkerContext.backend``).
        self.config, self.name = config, name
        #: What every worker's environment gets (``worker_environment``).
        self.worker_env = worker_environment(config, os.environ)
        #: Set while the core stops these workers to start them again (a recovery): a
        #: transport whose remote agents can take part again asks them to rejoin.
        self.restarting = False
        self._hooks, self._recovery = hooks, recovery
        self._table = CallTable()
        self._table.confirm = self._confirm_failure
        #: ``deliver(seq, rank, ok, value)``: ``rank``'s reply to call ``seq``, ``ok`` with the
        #: result, else the failure (a :class:`~executor_core.backend.RemoteFailure` or an
        #: exception). Thread-safe.
        self.deliver: Callable[[int, int, bool, Any], None] = self._table.deliver
        self._state_lock = threading.Lock()
        #: Held while a call takes its sequence number and is sent: one order for every rank.
        self._send_lock = threading.Lock()
        #: Held around ``Transport.probe``: one probe at a time (the hang watch, a failure).
        self._probe_lock = threading.Lock()
        self._closed = False
        self._released = False
        self._failure: ExecutorFailedError | None = None
        self._transport: Transport | None = None
        self._replies: Replies | None = None
        self._hang_watch: HangWatch | None = None
        #: Each run with the host that runs it (after a replacement, the one that took over).
        self._cleanups: list[Callable[[TransportHost], None]] = []
        #: What transports keep across a recovery, shared by every host of one executor.
        self._kept: dict[str, tuple[Any, Callable[[], None]]] = {}
        #: The rendezvous port kept (one cell, shared with a host that takes over).
        self._rendezvous: list[int] = []
        #: Each rank's node, as :meth:`context` made it.
        self._node_of: dict[int, str] = {}
        # What worker_env replaces in this process: an in-process worker applies it to the
        # driver's environment, and release puts it back.
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
        node_address: str = "",
    ) -> WorkerContext:
        """The :class:`WorkerContext` of ``rank``; the config's fields and :attr:`name` are
        filled in here."""
        config = self.config
        self._node_of[rank] = node_id
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
            node_address=node_address,
            backend=self.name,
        )

    def contexts(
        self,
        node_ids: Sequence[str] | None = None,
        init_method: str | None = None,
        node_addresses: Mapping[str, str] | None = None,
    ) -> list[WorkerContext]:
        """Every rank's context, in rank order. ``node_ids[rank]`` names each rank's node
        (default: every rank on this machine); local ranks count up per node in rank order.
        ``init_method`` defaults to :meth:`rendezvous`. ``node_addresses`` maps a node id to
        its address (``WorkerContext.node_address``)."""
        world_size = self.config.world_size
        nodes = list(node_ids or [socket.gethostname()] * world_size)
        if len(nodes) != world_size:
            raise ValueError(f"node_ids has {len(nodes)} entries for {world_size} ranks")
        init_method = init_method or self.rendezvous()
        local = [nodes[:rank].count(node) for rank, node in enumerate(nodes)]
        return [
            self.context(
                rank,
                local_rank=local[rank],
                local_world_size=nodes.count(node),
                node_id=node,
                init_method=init_method,
                node_address=(node_addresses or {}).get(node, ""),
            )
            for rank, node in enumerate(nodes)
        ]

    def rendezvous(self, host: str | None = None) -> str:
        """A ``tcp://`` torch.distributed rendezvous on ``host`` (default
        ``config.distributed_host``, an address of this machine), at a port this executor
        keeps free (``reserve_port``) until its workers stopped or the next rendezvous
        replaces it: rank 0's store binds it however long a worker waits to join."""
        host = host or self.config.distributed_host
        port = reserve_port(host)
        cell = self._rendezvous
        with self._state_lock:
            previous, cell[:] = cell[:], [port]
        if previous:
            release_port(previous[0])
        else:
            self.add_cleanup(lambda: release_port(cell[0]))
        return tcp_init_method(host, port)

    def wrapper(self, context: WorkerContext) -> WorkerWrapper:
        """The wrapper that hosts ``context``'s worker: in this process as it is (with this
        registry's hooks), or pickled to the worker's process (which loads its own)."""
        config = self.config
        return WorkerWrapper(
            config.worker_cls, config.worker_kwargs, context, env=self.worker_env, hooks=self._hooks
        )

    # --- for transports: running ----------------------------------------------------------

    def worker_died(self, error: ExecutorFailedError) -> None:
        """A worker (or the transport itself) is gone for good: the executor fails with
        ``error`` (typically :class:`~executor_core.WorkerDiedError`), or recovers by its
        policy; the calls in flight raise it. Thread-safe; later reports are ignored."""
        self._fail(error)

    def while_blocked(self, timeout: float = 0.0) -> bool:
        """Call while :meth:`Transport.send` waits for room: if no other thread reads replies,
        read them here, up to ``timeout`` seconds (a worker blocked on a full reply queue can
        then go on). False if another thread reads replies (wait on your own condition)."""
        replies = self._replies
        return replies is not None and replies.while_blocked(timeout)

    @property
    def closed_error(self) -> ExecutorError | None:
        """The error calls fail with once the executor failed or is closing, else None."""
        return self._table.closed_error

    def add_cleanup(self, callback: Callable[[], None]) -> None:
        """Register a releaser, run once after the workers stopped and every reader left (last
        in, first out), at shutdown, at a recovery or by the finalizer. It must not
        reference the executor."""
        with self._state_lock:
            self._cleanups.append(lambda _host: callback())

    def keep(self, name: str, value: Any, release: Callable[[], None]) -> None:
        """Register ``value`` (a cluster session, a placement the next workers should reuse):
        when these workers stop for a recovery (:attr:`restarting`), the next incarnation's
        transport gets it back with :meth:`take`; otherwise, and if nobody takes it,
        ``release()`` runs."""

        def keep_or_release(host: TransportHost) -> None:
            if host.restarting:
                host._kept[name] = (value, release)
            else:
                release()

        with self._state_lock:
            self._cleanups.append(keep_or_release)

    def take(self, name: str) -> Any:
        """What the previous incarnation kept under ``name`` (:meth:`keep`), or None."""
        entry = self._kept.pop(name, None)
        return None if entry is None else entry[0]

    # --- the core's own -----------------------------------------------------------------

    def _attach(self, transport: Transport) -> Replies:
        self._transport = transport
        self._replies = Replies(self._table, transport)
        return self._replies

    def _take_over(self, old: TransportHost) -> None:
        """A rank replacement: this host carries on ``old``'s transport and takes what ``old``
        would have released; it returns once no thread sends or reads replies through it."""
        if old._send_lock.acquire(timeout=_LEAVE_S):
            old._send_lock.release()
        if old._replies is not None:
            old._replies.leave(_LEAVE_S)
        with old._state_lock:
            cleanups, old._cleanups, old._released = old._cleanups, [], True
        with self._state_lock:
            self._cleanups[:0] = cleanups
        self._kept, self._saved_env = old._kept, old._saved_env
        self._rendezvous, self._node_of = old._rendezvous, old._node_of

    def _node_named(self, ranks: Sequence[int]) -> str | None:
        """The node of ``ranks`` where the job spans several and they share one, else None."""
        nodes = {self._node_of.get(rank) for rank in ranks}
        if len(nodes) != 1 or len(set(self._node_of.values())) < 2:
            return None
        return nodes.pop()

    def _check_open(self) -> None:
        if self._closed:
            raise ExecutorClosedError("the executor has been shut down; create a new one")
        if self._failure is not None:
            raise self._failure

    def _fail(self, error: ExecutorFailedError) -> bool:
        """Fail with ``error`` once: the recovery decides (and reports the death, and runs the
        failure callbacks when it is final) before the calls in flight fail, so that whoever
        sees the error finds the state changed; then the recovery thread starts, if any."""
        with self._state_lock:
            if self._failure is not None or self._closed:
                return False
            self._failure = error
        if self._recovery is not None:
            self._recovery.failing(self, error)
        self._abort(error)
        if self._recovery is not None:
            self._recovery.failed(error)
        return True

    def _abort(self, error: ExecutorError) -> None:
        """Fail every call in flight with ``error``; wake whatever the transport blocks."""
        if self._table.close(error):
            if self._replies is not None:
                self._replies.wake()
            if self._hang_watch is not None:
                self._hang_watch.stop()
            if self._transport is not None:
                run_logged("interrupting the transport", self._transport.interrupt)

    def _release(self, graceful: bool) -> None:
        """Stop the transport, fail what is left in flight, wait for readers to leave, restore
        the environment, run the cleanups. Once."""
        if self._released:
            return
        self._released = True
        try:
            try:
                if self._transport is not None:
                    self._transport.close(graceful)
            finally:
                closed = ExecutorClosedError("the executor was shut down during the call")
                self._abort(self._failure or closed)
            if not graceful and self._send_lock.acquire(timeout=_LEAVE_S):
                self._send_lock.release()
            if self._replies is not None:
                self._replies.leave(_LEAVE_S)
        finally:
            for key, value in self.worker_env.items():  # undo an in-process worker's env
                if os.environ.get(key) == value:
                    saved = self._saved_env[key]
                    if saved is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = saved
            with self._state_lock:
                cleanups, self._cleanups = self._cleanups, []
            for cleanup in reversed(cleanups):
                run_logged("an executor cleanup", cleanup, self)

    def _confirm_failure(self, call: Call) -> ExecutorError | None:
        """``call`` failed with a worker's error while other ranks ran it without answering:
        where the transport has a probe, ask those ranks; if one does not answer, wait (a few
        seconds at most) for its death to be reported and return it, which the caller gets
        instead (a collective's "connection reset" on a survivor is the news of a peer's
        death). None: the failure stands."""
        transport, table = self._transport, self._table
        if (
            transport is None
            or not transport.can_probe()
            or not isinstance(call.error, WorkerError)
        ):
            return None
        driven = transport.ranks
        ranks = range(self.config.world_size) if driven is None else driven
        silent = [rank for rank in ranks if rank not in call.expected]
        if not silent:
            return None
        with self._probe_lock:
            try:
                gone = transport.probe(silent, _CONFIRM_PROBE_S)
            except Exception:  # noqa: BLE001 - a probe that breaks leaves the error as it is
                log_exception("the liveness probe of a failed call's other ranks failed")
                return None
        if not gone:
            return None
        with table.lock:
            table.cond.wait_for(lambda: table.closed_error is not None, _DEATH_REPORT_S)
        closed = table.closed_error
        return closed if isinstance(closed, WorkerDiedError) else None
