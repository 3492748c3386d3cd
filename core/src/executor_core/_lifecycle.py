"""The life of an executor, which :class:`~executor_core.Executor` inherits: made over its
backend's transport, then failed or shut down."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from time import perf_counter
from typing import TYPE_CHECKING, Any, ClassVar, Self

from ._admission import admit
from ._aio import AsyncSender
from ._config import ExecutorConfig
from ._errors import (
    ConfigError,
    ExecutorClosedError,
    ExecutorFailedError,
    WorkerDiedError,
)
from ._hangs import HangWatch, has_probe
from ._host import TransportHost
from ._observe import CallObserver, death_reporter
from ._recovery import Recovery
from ._recovery_policy import ExecutorState, RecoveryRecord
from ._resolve import executor_class
from ._sleep import SleepState
from ._ways_back import WaysBack, log_warning
from .options import NoOptions

if TYPE_CHECKING:
    from attrs import AttrsInstance

    from ._registry import BackendSpec, Registry
    from ._replies import Replies
    from ._transport import Transport

__all__ = ["FailureCallback", "Lifecycle"]

#: How long shutdown waits for a send in progress before it stops the workers by force.
_SEND_LOCK_S = 5.0
#: How long shutdown waits for a recovery in progress (told to give up) to end.
_RECOVERY_JOIN_S = 60.0


def _release_kept(kept: dict[str, tuple[Any, Callable[[], None]]]) -> None:
    """Release what a recovery's transports kept and no incarnation took back, in the order
    it was kept (each failure logged)."""
    while kept:
        name = next(iter(kept))
        _, release = kept.pop(name)
        try:
            release()
        except Exception:
            import logging

            logging.getLogger("executor_core").exception("releasing kept %r failed", name)


#: Called once with the error when the executor fails.
FailureCallback = Callable[[ExecutorFailedError], None]


class Lifecycle(WaysBack):
    """An executor's making, state and end (its calls are :class:`~executor_core.Executor`'s).

    Made: the config is checked against what the backend declares, the transport built over
    a :class:`TransportHost` and started. Ended: by :meth:`fail` (or a worker's death), by
    :meth:`shutdown`, or, for an executor dropped without :meth:`shutdown`, by its finalizer,
    which holds the host and never the executor.
    """

    #: The backend's transport class: how workers start and stop and how calls reach them.
    transport_cls: ClassVar[type[Transport]]
    #: The backend's options: an attrs class whose fields are the ``backend_options`` keys it
    #: takes (see ``executor_core.options``). The core refuses any other key, and a bad value,
    #: before the transport is built; the default, :class:`~executor_core.options.NoOptions`,
    #: takes none.
    options_cls: ClassVar[type[AttrsInstance]] = NoOptions

    def __init__(
        self,
        config: ExecutorConfig,
        *,
        registry: Registry | None = None,
        spec: BackendSpec | None = None,
    ) -> None:
        if not isinstance(config, ExecutorConfig):
            raise TypeError(f"config must be an ExecutorConfig, not {type(config).__name__}")
        cls = type(self)
        if getattr(cls, "transport_cls", None) is None:
            raise TypeError(
                f"{cls.__qualname__} names no transport: set transport_cls = YourTransport "
                "(see executor_core.backend)"
            )
        self.config = config
        self._registry = registry
        name, spec = admit(cls, config, self.registry, spec)
        #: Whether a death is answered by replacing the dead ranks: as the spec declares, or,
        #: for a class no plugin declares, if its transport implements ``replace``.
        self._replaces: bool | None = (
            None if spec is None else spec.capabilities.recovery == "replace"
        )
        self._all_ranks = tuple(range(config.world_size))
        self._step_reply: tuple[int | None, tuple[int, ...]] = (None, self._all_ranks)
        self._default_timeout = config.rpc_timeout
        self._next_seq = 1
        hooks = self.registry.hook
        self._name = name
        # Driver-side observer hooks: per call (tested cheaply on every call), on a worker's
        # death (a failure callback holding the hooks and the name, never the executor).
        observer = CallObserver(hooks, name, config.world_size)
        self._observer = observer
        self._calls_started, self._calls_finished = observer.impls
        #: The recovery state and the failure callbacks; it reaches the executor only through
        #: a weak method, so a dropped executor is still collected.
        self._recovery = Recovery(config.recovery, name, hooks, self._come_back)
        #: The host whose transport is starting (at creation, in a recovery), else None.
        self._starting: TransportHost | None = None
        #: What transports hand over across a recovery (``TransportHost.keep``), released at
        #: shutdown, or by this finalizer, if no incarnation took it back.
        self._kept: dict[str, tuple[Any, Callable[[], None]]] = {}
        weakref.finalize(self, _release_kept, self._kept)
        #: Sends the asyncio calls from its own thread (started on the first one).
        self._aio = AsyncSender(f"executor-{name}-asyncio")
        weakref.finalize(self, self._aio.close)  # holds the sender: its thread ends
        self._install(first=True)

    def _new_host(self) -> TransportHost:
        """A host wired to this executor's hooks and recovery (never to the executor)."""
        hooks = self.registry.hook
        host = TransportHost(self.config, self._name, hooks)
        host.kept = self._kept  # what an earlier incarnation's transport handed over
        host.failure_callbacks.append(death_reporter(hooks, self._name))
        host.failure_callbacks.append(self._recovery.decide)
        host.after_abort = self._recovery.on_failure
        return host

    def _install(self, first: bool = False) -> None:
        """Build a host and a transport over it, and start the workers: at creation, and for
        each group restart (the calls in flight failed with the old host; nothing of its is
        reused, so no reply from before a death reaches a call made after it)."""
        host = self._new_host()
        transport = self._create_transport(host)
        if self.config.hang_timeout_s is not None and not has_probe(transport):
            raise ConfigError(
                "hang_timeout_s",
                self.config.hang_timeout_s,
                f"{type(transport).__qualname__} has no liveness probe (Transport.probe); "
                "leave hang_timeout_s=None",
            )
        replies = host.attach(transport)
        # The finalizer holds the host, never the executor: a dropped executor is collected,
        # and what it left running is stopped by force.
        finalizer = weakref.finalize(self, host.release, False)
        # Published only once started: a call never reaches a transport that is starting.
        self._starting = host
        try:
            transport.start()
        except BaseException:
            if first:  # nobody will see this executor: calls on it would find it closed
                host.closed = True
            else:  # a recovery's attempt: the next one may follow
                host.restarting = True
            finalizer()
            raise
        finally:
            self._starting = None
        driven = transport.ranks
        self._all_ranks = ranks = (
            tuple(driven) if driven is not None else tuple(range(self.world_size))
        )
        # execute_model's reply rank and the ranks it waits for: the output rank, or, where this
        # transport does not drive it (SPMD), the ranks it does.
        output = self.config.output_rank
        self._step_reply = (output, (output,)) if output in ranks else (None, ranks)
        self._publish(host, transport, replies, finalizer)
        self._run_inline = transport.inline_runner() if len(self._all_ranks) == 1 else None

    def _publish(
        self,
        host: TransportHost,
        transport: Transport,
        replies: Replies,
        finalizer: weakref.finalize[Any, Any],
    ) -> None:
        """Calls go to ``host`` from now on (its workers are ready)."""
        self._host, self._transport, self._replies = host, transport, replies
        self._finalizer = finalizer
        self._sleep = SleepState(host, self.registry.hook)
        bound = self.config.hang_timeout_s
        if bound is not None:
            watch = host.hang_watch = HangWatch(host, transport, self._all_ranks, bound)
            watch.start()

    def _create_transport(self, host: TransportHost) -> Transport:
        """Build the transport (override to pass more than the host; never pass ``self``)."""
        return self.transport_cls(host)

    #: ``get_class(config, registry=None)``: the Executor subclass for ``config.backend``.
    get_class = staticmethod(executor_class)

    @property
    def transport(self) -> Transport:
        """The backend's transport (for a backend's own extras)."""
        return self._transport

    # --- state -------------------------------------------------------------------------

    @property
    def registry(self) -> Registry:
        """The plugin registry this executor was created from (the default one otherwise)."""
        if self._registry is None:
            from ._registry import default_registry

            self._registry = default_registry()
        return self._registry

    @property
    def backend_name(self) -> str:
        """The backend's name (as workers see it in ``WorkerContext.backend``)."""
        return self._host.name

    @property
    def world_size(self) -> int:
        """Number of workers."""
        return self.config.world_size

    @property
    def output_rank(self) -> int:
        """The rank whose result :meth:`execute_model` returns."""
        return self.config.output_rank

    @property
    def max_concurrent_batches(self) -> int:
        """How many ``execute_model`` calls the caller should keep in flight."""
        if self.config.pipeline_parallel_size > 1:
            return self.config.pipeline_parallel_size
        return 2 if self.config.async_scheduling else 1

    @property
    def is_closed(self) -> bool:
        """True once :meth:`shutdown` has been called."""
        return self._host.closed

    @property
    def state(self) -> ExecutorState:
        """Running, recovering (workers died and are being started again), failed for good,
        or closed: see :class:`~executor_core.ExecutorState`."""
        state = self._recovery.state
        if state is ExecutorState.RUNNING and self._host.failure is not None:
            return ExecutorState.FAILED if self._recovery.policy is None else state
        return state

    @property
    def last_recovery(self) -> RecoveryRecord | None:
        """What the last completed recovery did (which ranks died, which got new processes,
        how long it took), or None if none completed."""
        return self._recovery.last

    @property
    def last_death(self) -> WorkerDiedError | None:
        """The death of workers the executor is recovering from, or last recovered from
        (None if none was): its ``ranks`` are those that were started again."""
        return self._recovery.last_death

    @property
    def is_failed(self) -> bool:
        """True once the executor has failed for good (see :meth:`register_failure_callback`):
        with a recovery policy, not while it recovers."""
        if self._recovery.policy is None:
            return self._host.failure is not None
        return self._recovery.state is ExecutorState.FAILED

    @property
    def failure(self) -> ExecutorFailedError | None:
        """The error the executor failed with for good, if it has."""
        if self._recovery.policy is None:
            return self._host.failure
        return self._recovery.final

    def register_failure_callback(self, callback: FailureCallback) -> None:
        """Call ``callback(error)`` once if the executor fails for good (at once if it already
        has). A death that a recovery policy brings the executor back from is not a failure
        (the ``executor_recovery_started`` hook reports it)."""
        self._recovery.register(callback)

    def fail(self, error: ExecutorFailedError) -> bool:
        """Mark the executor failed with ``error``: every call in flight and every later call
        raises it, and the failure callbacks run, once; no recovery policy brings it back
        (:meth:`recover` may). Returns False if it had already failed (or was shut down)."""
        if not isinstance(error, ExecutorFailedError):
            raise TypeError(f"error must be an ExecutorFailedError, not {type(error).__name__}")
        self._recovery.refuse_next = True
        failed = self._host.fail(error)
        if not failed:
            self._recovery.refuse_next = False
        return failed

    def recover(self, timeout: float | None = None) -> None:
        """Bring a failed executor back now: stop every worker and start them again (fresh
        contexts, ``init_device`` and ``load_model`` again), whatever the recovery policy
        says; wait for a recovery that runs already. Returns once calls reach the workers
        again; raises the error of a failed attempt (the executor is then failed). Calls in
        flight at the failure are never replayed: resubmit what you need."""
        from ._errors import RPCTimeoutError

        recovery = self._recovery
        if self._host.closed:
            raise ExecutorClosedError("the executor has been shut down; create a new one")
        if not recovery.begin_explicit():  # one runs: wait for it
            if recovery.wait(timeout) is ExecutorState.RECOVERING:
                raise RPCTimeoutError("recover", list(self._all_ranks), timeout or 0.0)
            if recovery.state is ExecutorState.FAILED:
                assert recovery.final is not None
                raise recovery.final
            return
        failure = self._host.failure
        ranks = tuple(getattr(failure, "ranks", ()) or self._all_ranks)
        start = perf_counter()
        try:
            self._restart()
        except ExecutorClosedError:
            raise
        except Exception as exc:
            error = ExecutorFailedError(f"recovering the executor failed: {exc}")
            error.__cause__ = exc
            recovery.end_explicit(error, ranks, perf_counter() - start)
            raise error from exc
        did = ("restart", self._all_ranks, "")
        recovery.end_explicit(None, ranks, perf_counter() - start, did)

    def shutdown(self) -> None:
        """Stop the workers (each runs its ``shutdown``) and release every resource; calls in
        flight raise :class:`ExecutorClosedError`. Idempotent."""
        starting = self._starting
        if starting is not None:
            # A start in progress gives up at once; the recovery ends before the release.
            starting.abort(ExecutorClosedError("the executor was shut down"))
        left = self._recovery.close(_RECOVERY_JOIN_S)
        if left is not None:
            log_warning("the recovery thread did not end; its workers are left to the finalizer")
        host = self._host
        with host.state_lock:
            if host.closed:
                return
            host.closed = True
            host.failure_callbacks.clear()
        # Graceful only if no send is stuck: the stop must not interleave with a call.
        graceful = host.failure is None and host.send_lock.acquire(timeout=_SEND_LOCK_S)
        try:
            host.release(graceful)
        finally:
            if graceful:
                host.send_lock.release()
            self._finalizer.detach()
            _release_kept(self._kept)
            self._aio.close()  # after the release: a send it waits on has ended

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
