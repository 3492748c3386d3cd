"""The life of an executor, which :class:`~executor_core.Executor` inherits: made over its
backend's transport, then failed or shut down."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, Self

from ._admission import admit
from ._aio import AsyncSender
from ._config import ExecutorConfig
from ._errors import ExecutorFailedError
from ._host import TransportHost, run_callback
from ._observe import CallObserver, death_reporter
from ._resolve import executor_class
from ._sleep import SleepState
from .options import NoOptions

if TYPE_CHECKING:
    from attrs import AttrsInstance

    from ._registry import BackendSpec, Registry
    from ._transport import Transport

__all__ = ["FailureCallback", "Lifecycle"]

#: How long shutdown waits for a send in progress before it stops the workers by force.
_SEND_LOCK_S = 5.0

#: Called once with the error when the executor fails.
FailureCallback = Callable[[ExecutorFailedError], None]


class Lifecycle:
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
        name = admit(cls, config, self.registry, spec)
        self._all_ranks = tuple(range(config.world_size))
        self._default_timeout = config.rpc_timeout
        self._next_seq = 1
        hooks = self.registry.hook
        host = TransportHost(config, name, hooks)
        self._host = host
        self._sleep = SleepState(host, hooks)
        # Driver-side observer hooks: per call (tested cheaply on every call), on a worker's
        # death (a failure callback holding the hooks and the name, never the executor).
        observer = CallObserver(hooks, name, config.world_size)
        self._observer = observer
        self._calls_started, self._calls_finished = observer.impls
        host.failure_callbacks.append(death_reporter(hooks, name))
        transport = self._create_transport(host)
        self._replies = host.attach(transport)
        self._transport = transport
        # The finalizer holds the host, never the executor: a dropped executor is collected,
        # and what it left running is stopped by force.
        self._finalizer = weakref.finalize(self, host.release, False)
        #: Sends the asyncio calls from its own thread (started on the first one).
        self._aio = AsyncSender(f"executor-{name}-asyncio")
        weakref.finalize(self, self._aio.close)  # holds the sender: its thread ends
        try:
            transport.start()
        except BaseException:
            host.closed = True
            self._finalizer()
            raise
        driven = transport.ranks
        if driven is not None:
            self._all_ranks = tuple(driven)
        self._run_inline = transport.inline_runner() if len(self._all_ranks) == 1 else None

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
    def is_failed(self) -> bool:
        """True once the executor has failed (see :meth:`register_failure_callback`)."""
        return self._host.failure is not None

    @property
    def failure(self) -> ExecutorFailedError | None:
        """The error the executor failed with, if it has."""
        return self._host.failure

    def register_failure_callback(self, callback: FailureCallback) -> None:
        """Call ``callback(error)`` once if the executor fails (at once if it already has)."""
        host = self._host
        with host.state_lock:
            failure = host.failure
            if failure is None:
                host.failure_callbacks.append(callback)
                return
        run_callback(callback, failure)

    def fail(self, error: ExecutorFailedError) -> bool:
        """Mark the executor failed with ``error``: every call in flight and every later call
        raises it, and the failure callbacks run, once. Returns False if it had already
        failed (or was shut down)."""
        if not isinstance(error, ExecutorFailedError):
            raise TypeError(f"error must be an ExecutorFailedError, not {type(error).__name__}")
        return self._host.fail(error)

    def shutdown(self) -> None:
        """Stop the workers (each runs its ``shutdown``) and release every resource; calls in
        flight raise :class:`ExecutorClosedError`. Idempotent."""
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
            self._aio.close()  # after the release: a send it waits on has ended

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
