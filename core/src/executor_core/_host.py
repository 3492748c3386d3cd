"""The core's side of a transport, :class:`TransportHost`: all a transport may reach.

It holds the calls in flight, the failure state, the cleanups and the environment to restore,
and nothing that references the executor: the executor's finalizer holds the host alone, so
an executor dropped without ``shutdown()`` is collected whatever the transport's threads
hold, and the finalizer still stops the transport.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._calls import Call, CallTable
from ._config import worker_environment
from ._errors import ExecutorClosedError, ExecutorError, ExecutorFailedError
from ._net import release_port, reserve_port, tcp_init_method
from ._replies import Replies
from ._worker import WorkerContext
from ._wrapper import WorkerWrapper

if TYPE_CHECKING:
    import pluggy

    from ._config import ExecutorConfig
    from ._hangs import HangWatch
    from ._transport import Transport

__all__ = ["TransportHost", "run_callback"]

#: How long a release waits for a thread still sending or reading replies to leave the
#: transport before the cleanups release what it uses.
_LEAVE_S = 2.0
#: A failed call whose other ranks ran it silently (``unique_reply_rank``): how long the
#: liveness probe of those ranks may take, and, if one of them does not answer, how long the
#: core waits for its death to be reported (then the call raises the death, not the error).
_CONFIRM_PROBE_S = 1.0
_DEATH_REPORT_S = 2.0


def _log_exception(message: str, *args: object) -> None:
    import logging  # deferred: only needed on error paths

    logging.getLogger("executor_core").exception(message, *args)


class TransportHost:
    """The core's side of a transport: one per executor (see the module).

    Transports use :attr:`config`, :attr:`name`, :meth:`contexts` and :meth:`wrapper` to
    start workers, :attr:`deliver` and :meth:`worker_died` to report, :meth:`add_cleanup` for
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
        #: Set while the core stops this host's workers to start them again (a recovery):
        #: a transport whose remote agents can take part again asks them to rejoin in
        #: ``close()`` rather than to exit.
        self.restarting = False
        #: What transports keep across a recovery's restart (see :meth:`keep`), shared by
        #: every host of one executor: ``name -> (value, release)``.
        self.kept: dict[str, tuple[Any, Callable[[], None]]] = {}
        self.failure: ExecutorFailedError | None = None
        #: Run once with the failure in :meth:`fail`, before the calls in flight are failed:
        #: whoever gets the error finds the death reported and the executor recovering or
        #: failed (the core's recovery decides there, and runs the user's callbacks).
        self.failure_callbacks: list[Callable[[ExecutorFailedError], None]] = []
        #: Called with the failure once the calls in flight have failed (the core's recovery
        #: starts its thread there).
        self.after_abort: Callable[[ExecutorFailedError], None] | None = None
        self.table = CallTable()
        self.table.confirm = self.confirm_failure
        #: Held around every call of ``Transport.probe``: the core probes from one thread at
        #: a time (the hang watch, a failed call's confirmation).
        self.probe_lock = threading.Lock()
        #: ``deliver(seq, rank, ok, value)``: ``rank``'s reply to call ``seq``, ``ok`` with
        #: the result, or not with the failure (a :class:`~executor_core.RemoteFailure` or an
        #: exception). Thread-safe. It is the call table's own method, so that no frame of the
        #: host's is on the path of every reply.
        self.deliver: Callable[[int, int, bool, Any], None] = self.table.deliver
        #: Held while a call takes its sequence number and is sent: one order for every rank.
        self.send_lock = threading.Lock()
        self.transport: Transport | None = None
        #: How replies reach waiting calls; made by :meth:`attach`.
        self.replies: Replies | None = None
        #: Declares hung ranks dead (``ExecutorConfig.hang_timeout_s``), once started.
        self.hang_watch: HangWatch | None = None
        self._cleanups: list[Callable[[], None] | _KeepOrRelease] = []
        self.released = False
        #: What every worker's environment gets (see ``worker_environment``), fixed when the
        #: executor is created.
        self.worker_env = worker_environment(config, os.environ)
        # What that replaces in this process: an in-process worker applies it to the driver's
        # environment, and release puts it back (see _restore_env).
        self._saved_env = {key: os.environ.get(key) for key in self.worker_env}
        #: The port :meth:`rendezvous` keeps (one cell, shared with a host that takes over).
        self._rendezvous: list[int] = []
        #: Each rank's node, as :meth:`context` made it (the errors the core raises of a rank,
        #: a hang say, name its node where the job spans several).
        self.node_of: dict[int, str] = {}

    def take_over(self, old: TransportHost) -> None:
        """A rank replacement: this host carries on ``old``'s transport, so it takes what
        ``old`` would have released (its cleanups, the environment to restore); ``old``,
        failed already, releases nothing. Returns once no thread sends or reads replies
        through ``old`` (they leave at once: it is interrupted)."""
        if old.send_lock.acquire(timeout=_LEAVE_S):
            old.send_lock.release()
        if old.replies is not None:
            old.replies.leave(_LEAVE_S)
        with old.state_lock:
            cleanups, old._cleanups = old._cleanups, []
            old.released = True
        with self.state_lock:
            self._cleanups[:0] = cleanups
        self._saved_env = old._saved_env
        self._rendezvous = old._rendezvous
        self.node_of = old.node_of

    def attach(self, transport: Transport) -> Replies:
        """Take the executor's transport (once, before it starts); return its :class:`Replies`."""
        self.transport = transport
        replies = self.replies = Replies(self.table, transport)
        return replies

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
        self.node_of[rank] = node_id
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
        (default: every rank on this host); local ranks count up per node in rank order.
        ``init_method`` defaults to :meth:`rendezvous` on ``config.distributed_host``.
        ``node_addresses`` maps a node id to its address (``WorkerContext.node_address``)."""
        world_size = self.config.world_size
        if node_ids is None:
            node_ids = [socket.gethostname()] * world_size
        if len(node_ids) != world_size:
            raise ValueError(f"node_ids has {len(node_ids)} entries for {world_size} ranks")
        if init_method is None:
            init_method = self.rendezvous()
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
                node_address=(node_addresses or {}).get(node, ""),
            )
            for rank, node in enumerate(node_ids)
        ]

    def rendezvous(self, host: str | None = None) -> str:
        """A ``tcp://`` torch.distributed rendezvous on ``host`` (default
        ``config.distributed_host``, which must be this machine) at a port that this executor
        keeps free (:func:`reserve_port`) until its workers have stopped or the next
        rendezvous replaces it: rank 0's store binds it however long a worker waits to join."""
        host = host or self.config.distributed_host
        port = reserve_port(host)
        cell = self._rendezvous
        with self.state_lock:
            previous = cell[:]
            cell[:] = [port]
        if previous:
            release_port(previous[0])
        else:
            self.add_cleanup(lambda: release_port(cell[0]))
        return tcp_init_method(host, port)

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
        with self.state_lock:
            self._cleanups.append(callback)

    def keep(self, name: str, value: Any, release: Callable[[], None]) -> None:
        """While :attr:`restarting`: hand ``value`` (a cluster session, a placement the next
        workers should reuse) to the next incarnation's transport instead of releasing it;
        :meth:`take` gets it back. ``release()`` runs if nobody takes it (the executor shut
        down or failed for good), in the order values were kept."""
        self.kept[name] = (value, release)

    def keep_or_release(self, name: str, value: Any, release: Callable[[], None]) -> None:
        """Register a cleanup that hands ``value`` to the next incarnation (:meth:`keep`)
        if the executor is restarting when it runs, and calls ``release()`` otherwise. The
        host that runs it decides: after a rank replacement, the one that took over."""
        with self.state_lock:
            self._cleanups.append(_KeepOrRelease(name, value, release))

    def take(self, name: str) -> Any:
        """What the previous incarnation kept under ``name`` (:meth:`keep`), or None."""
        entry = self.kept.pop(name, None)
        return None if entry is None else entry[0]

    # --- for transports: reporting -----------------------------------------------------

    def worker_died(self, error: ExecutorFailedError) -> None:
        """A worker (or the transport itself) is gone for good: the executor fails with
        ``error`` (typically :class:`~executor_core.WorkerDiedError`), every call in flight
        raises it, and the failure callbacks run once. Thread-safe; later reports are
        ignored."""
        self.fail(error)

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
        replies = self.replies
        return replies is not None and replies.while_blocked(timeout)

    def confirm_failure(self, call: Call) -> ExecutorError | None:
        """``call`` failed with a worker's error while other ranks ran it without answering
        (``unique_reply_rank``): where the transport has a liveness probe, ask those ranks;
        if one does not answer, wait (at most a few seconds) for its death to be reported
        and return that death, which the caller gets instead (a collective's "connection
        reset" on a survivor is the news of a peer's death, not a bug of its own). None: the
        failure stands (every such rank answered, no probe, or no death reported)."""
        from ._errors import WorkerDiedError, WorkerError
        from ._hangs import has_probe

        transport, table = self.transport, self.table
        if transport is None or not isinstance(call.error, WorkerError) or not has_probe(transport):
            return None
        driven = transport.ranks
        ranks = range(self.config.world_size) if driven is None else driven
        silent = [rank for rank in ranks if rank not in call.expected]
        if not silent:
            return None
        with self.probe_lock:
            try:
                gone = transport.probe(silent, _CONFIRM_PROBE_S)
            except Exception:  # noqa: BLE001 - a probe that breaks leaves the error as it is
                _log_exception("the liveness probe of a failed call's other ranks failed")
                return None
        if not gone:
            return None
        with table.lock:
            table.cond.wait_for(lambda: table.closed_error is not None, _DEATH_REPORT_S)
            closed = table.closed_error
        return closed if isinstance(closed, WorkerDiedError) else None

    def node_named(self, ranks: Sequence[int]) -> str | None:
        """The node of ``ranks`` where the job spans several nodes and they are all on one,
        else None (as a worker's death on a single node is reported)."""
        nodes = {self.node_of.get(rank) for rank in ranks}
        if len(nodes) != 1 or len(set(self.node_of.values())) < 2:
            return None
        return nodes.pop()

    # --- for the executor: failure and shutdown ----------------------------------------

    def check_open(self) -> None:
        """Raise if the executor is closed or has failed."""
        if self.closed:
            raise ExecutorClosedError("the executor has been shut down; create a new one")
        failure = self.failure
        if failure is not None:
            raise failure

    def fail(self, error: ExecutorFailedError) -> bool:
        """Mark the executor failed with ``error`` (once): run the failure callbacks, then fail
        the calls in flight and interrupt the transport. False if it had failed or closed
        already."""
        with self.state_lock:
            if self.failure is not None or self.closed:
                return False
            self.failure = error  # first, so that whoever sees the error sees is_failed too
            callbacks, self.failure_callbacks = self.failure_callbacks, []
        for callback in callbacks:
            run_callback(callback, error)
        self.abort(error)
        if self.after_abort is not None:
            self.after_abort(error)
        return True

    def abort(self, error: ExecutorError) -> None:
        """Fail every call in flight with ``error`` and wake whatever the transport blocks."""
        if self.table.close(error):
            if self.replies is not None:
                self.replies.wake()
            if self.hang_watch is not None:
                self.hang_watch.stop()
            transport = self.transport
            if transport is not None:
                try:
                    transport.interrupt()
                except Exception:  # noqa: BLE001 - logged; the release goes on
                    _log_exception("interrupting the transport failed")

    def release(self, graceful: bool) -> None:
        """Stop the transport, fail what is left in flight, wait for readers to leave, restore
        the environment, run the cleanups. Once; the finalizer calls it with
        ``graceful=False``."""
        if self.released:
            return
        self.released = True
        transport = self.transport
        try:
            try:
                if transport is not None:
                    transport.close(graceful)
            finally:
                # A failure's own error where there is one (a failure callback may shut the
                # executor down before the calls in flight got it).
                closed = ExecutorClosedError("the executor was shut down during the call")
                self.abort(self.failure or closed)
            # Let senders and readers leave the transport before the cleanups release what
            # they use (a graceful release already holds the send lock).
            if not graceful and self.send_lock.acquire(timeout=_LEAVE_S):
                self.send_lock.release()
            if self.replies is not None:
                self.replies.leave(_LEAVE_S)
        finally:
            self._restore_env()
            self._run_cleanups()

    def _run_cleanups(self) -> None:
        with self.state_lock:
            callbacks, self._cleanups = self._cleanups, []
        errors: list[BaseException] = []
        for callback in reversed(callbacks):
            try:
                callback(self) if isinstance(callback, _KeepOrRelease) else callback()
            except Exception as exc:  # noqa: BLE001 - run every releaser (each is logged), then report
                _log_exception("executor cleanup %r failed", callback)
                errors.append(exc)
        if errors:
            raise ExecutorError(f"{len(errors)} cleanup step(s) failed") from errors[0]

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


class _KeepOrRelease:
    """A cleanup of :meth:`TransportHost.keep_or_release`: run with the host that runs it."""

    def __init__(self, name: str, value: Any, release: Callable[[], None]) -> None:
        self.name, self.value, self.release = name, value, release

    def __call__(self, host: TransportHost) -> None:
        if host.restarting:
            host.keep(self.name, self.value, self.release)
        else:
            self.release()

    def __repr__(self) -> str:
        return f"keep_or_release({self.name!r})"
