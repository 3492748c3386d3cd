"""Executor: the one implementation of every rule of a call, over a backend's transport."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from time import perf_counter
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar, overload

import attrs

from ._calls import Call, as_worker_error
from ._config import ExecutorConfig
from ._errors import (
    BackendLoadError,
    ConfigError,
    ExecutorClosedError,
    ExecutorError,
    ExecutorFailedError,
    RPCTimeoutError,
    SleepStateError,
)
from ._observe import CallObserver, Observation, ObservedCall, death_reporter, notify_sleep
from ._qualname import resolve_qualname
from ._transport import Transport, TransportHost, release_host, run_callback
from ._wire import method_name
from ._worker import SLEEP_TAGS
from .options import NoOptions, parse_backend_options

if TYPE_CHECKING:
    from attrs import AttrsInstance

    from ._aio import AsyncSender
    from ._registry import BackendSpec, Registry

__all__ = ["Executor", "FailureCallback", "chain_future", "create_executor"]


T = TypeVar("T")
U = TypeVar("U")

#: How long shutdown waits for a send in progress before it stops the workers by force.
_SEND_LOCK_S = 5.0

#: Called once with the error when the executor fails.
FailureCallback = Callable[[ExecutorFailedError], None]


def chain_future(source: Future[T], transform: Callable[[T], U]) -> Future[U]:
    """A future that completes with ``transform(source.result())`` (or source's exception)."""
    target: Future[U] = Future()
    target.set_running_or_notify_cancel()

    def done(fut: Future[T]) -> None:
        exc = fut.exception()
        if exc is not None:
            target.set_exception(exc)
            return
        try:
            target.set_result(transform(fut.result()))
        except BaseException as err:  # noqa: BLE001 - forwarded to the caller through the future
            target.set_exception(err)

    source.add_done_callback(done)
    return target


class Executor:
    """Runs a model's workers, one per rank, and drives them all through one object.

    Every rule of a call is implemented here, once: validation, one order of calls for all
    ranks whatever the number of calling threads, timeouts on blocking and non-blocking calls,
    ``unique_reply_rank``, reply and failure gathering (the lowest failing rank wins), failing
    the calls in flight on a worker's death, on :meth:`fail` and on :meth:`shutdown`, failure
    callbacks, sleep state, and cleanup (also when the executor is dropped without
    :meth:`shutdown`). Calls have asyncio forms too (:meth:`collective_rpc_async`,
    :meth:`execute_model_async`). A backend subclasses it only to name its
    :class:`Transport` (and to add extras of its own); see ``executor_core.backend``.
    """

    #: The backend's transport class: how workers start and stop and how calls reach them.
    transport_cls: ClassVar[type[Transport]]
    #: The backend's options: an attrs class whose fields are the ``backend_options`` keys it
    #: takes (see ``executor_core.options``). The core refuses any other key, and a bad value,
    #: before the transport is built; the default, :class:`~executor_core.options.NoOptions`,
    #: takes none.
    options_cls: ClassVar[type[AttrsInstance]] = NoOptions
    #: Sends the asyncio calls (made on the first one; see :meth:`collective_rpc_async`).
    _aio: AsyncSender | None = None

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
        if spec is None:
            spec = _spec_of(self.registry, cls)
        self._spec = spec
        if spec is not None:
            _check_capabilities(spec, config)
        name = spec.name if spec is not None else cls.__qualname__
        _check_backend_options(cls, config, name)
        self._all_ranks = tuple(range(config.world_size))
        self._default_timeout = config.rpc_timeout
        self._next_seq = 1
        self._sleeping_tags: set[str] = set()
        hooks = self.registry.hook
        host = TransportHost(config, name, hooks)
        self._host = host
        # Driver-side observer hooks: per call (tested cheaply on every call), on a worker's
        # death (a failure callback holding the hooks and the name, never the executor).
        observer = CallObserver(hooks, name, config.world_size)
        self._observer = observer
        self._calls_started, self._calls_finished = observer.impls
        host.failure_callbacks.append(death_reporter(hooks, name))
        transport = self._create_transport(host)
        host.transport = transport
        self._transport = transport
        # The finalizer holds the host, never the executor: a dropped executor is collected.
        self._finalizer = weakref.finalize(self, release_host, host)
        try:
            transport.start()
        except BaseException:
            host.closed = True
            self._finalizer()
            raise
        driven = transport.ranks
        if driven is not None:
            self._all_ranks = tuple(driven)
        run_inline = transport.inline_runner() if len(self._all_ranks) == 1 else None
        self._inline = run_inline is not None
        self._run_inline: Callable[..., Any] = run_inline or _no_inline_runner

    def _create_transport(self, host: TransportHost) -> Transport:
        """Build the transport (override to pass more than the host; never pass ``self``)."""
        return self.transport_cls(host)

    # --- resolving -------------------------------------------------------------------------

    @classmethod
    def get_class(cls, config: ExecutorConfig, registry: Registry | None = None) -> type[Executor]:
        """The Executor subclass for ``config.backend``.

        An Executor subclass or a ``"package.module:Class"`` string bypasses discovery; a name,
        an alias or ``"auto"`` is resolved through the plugin registry.
        """
        backend = config.backend
        if isinstance(backend, type):
            return _check_executor_class(backend, repr(backend))
        if ":" in backend:
            try:
                obj = resolve_qualname(backend)
            except ImportError as exc:
                raise BackendLoadError(f"cannot import executor class {backend!r}: {exc}") from exc
            return _check_executor_class(obj, backend)
        if registry is None:
            from ._registry import default_registry

            registry = default_registry()
        return registry.executor_class(registry.resolve_name(config))

    # --- calls -----------------------------------------------------------------------------

    @overload
    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: Literal[False] = False,
        unique_reply_rank: int | None = None,
    ) -> list[Any]: ...

    @overload
    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        non_block: Literal[True],
        unique_reply_rank: int | None = None,
    ) -> Future[list[Any]]: ...

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> list[Any] | Future[list[Any]]:
        """Run ``method`` on every worker and return the results in rank order.

        ``method`` is a worker method name or a callable ``fn(worker, *args, **kwargs)``.
        With ``unique_reply_rank`` only that rank's result is returned (a one-item list);
        every rank still runs the call. With ``non_block=True`` a
        :class:`~concurrent.futures.Future` of the list is returned; futures complete in
        submission order. ``timeout`` (seconds, default ``config.rpc_timeout``) applies to
        both forms: :class:`RPCTimeoutError` names the ranks that did not answer, and the
        executor stays usable (late replies are dropped). A worker exception raises
        :class:`WorkerError` (of the lowest failing rank); the executor stays usable.
        Calls from several threads reach every rank in one and the same order.
        """
        host = self._host
        table = host.table
        if host.closed or table.closed_error is not None:
            self._check_open()
        if timeout is not None or self._default_timeout is not None:
            timeout = self._resolve_timeout(timeout)
        if type(method) is not str and not callable(method):
            raise TypeError(
                "method must be a worker method name or a callable taking the worker, "
                f"not {type(method).__name__}"
            )
        if type(args) is not tuple:
            args = _as_args(args)
        if kwargs is not None and type(kwargs) is not dict:
            raise TypeError(f"kwargs must be a dict or None, not {type(kwargs).__name__}")
        expected = self._all_ranks
        if unique_reply_rank is not None:
            self._check_reply_rank(unique_reply_rank)
            if unique_reply_rank in expected:
                expected = (unique_reply_rank,)
            else:  # a rank this transport does not drive (SPMD): its own ranks answer
                unique_reply_rank = None
        if self._calls_started or self._calls_finished:  # a plugin observes calls
            return self._observed_rpc(
                method, timeout, args, kwargs, non_block, unique_reply_rank, expected
            )
        if self._inline and timeout is None and not non_block and not table.calls:
            # One rank, in this process, nothing in flight: a plain method call. No send lock:
            # with a single rank, calls from several threads have no order to disagree on.
            try:
                return [self._run_inline(method, args, kwargs)]
            except Exception as exc:  # every worker error becomes the caller's WorkerError
                raise as_worker_error(expected[0], method_name(method), exc) from exc
        return self._send_call(
            method, timeout, args, kwargs, non_block, unique_reply_rank, expected
        )

    def _send_call(
        self,
        method: str | Callable[..., Any],
        timeout: float | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        non_block: bool,
        unique_reply_rank: int | None,
        expected: tuple[int, ...],
        observation: Observation | None = None,
    ) -> list[Any] | Future[list[Any]]:
        """Send a validated call through the transport; wait for it unless ``non_block``.
        ``observation``: a non-blocking call's, reported when the call completes."""
        host = self._host
        table = host.table
        name = method if type(method) is str else method_name(method)
        transport = self._transport
        future: Future[list[Any]] | None = None
        if non_block:
            future = Future()
            future.set_running_or_notify_cancel()
        with host.send_lock:
            if host.closed:
                self._check_open()
            seq = self._next_seq
            self._next_seq = seq + 1
            if observation is None:
                call = Call(
                    seq, method, name, args, kwargs, unique_reply_rank, expected, timeout, future
                )
            else:
                call = ObservedCall(
                    observation,
                    seq,
                    method,
                    name,
                    args,
                    kwargs,
                    unique_reply_rank,
                    expected,
                    timeout,
                    future,
                )
            table.add(call)
            try:
                sent = transport.send(call)
            except Exception:
                table.remove(call)
                closed = table.closed_error
                if closed is not None:  # the transport gave up because the executor closed
                    raise closed from None
                raise
            except BaseException:  # Ctrl-C: the caller's own interruption goes through
                table.remove(call)
                raise
            if not sent:
                table.remove(call)
                if table.closed_error is not None:
                    raise table.closed_error
                error = RPCTimeoutError(name, list(self._all_ranks), timeout or 0.0)
                if future is None:
                    raise error
                call.finish(False, error)
        if future is not None:
            host.ensure_pump(call)
            return future
        return host.wait(call, transport)

    def _observed_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        non_block: bool,
        unique_reply_rank: int | None,
        expected: tuple[int, ...],
    ) -> list[Any] | Future[list[Any]]:
        """:meth:`collective_rpc` of a validated call, between the started and finished hooks
        (some plugin implements one of them)."""
        name = method if type(method) is str else method_name(method)
        observer = self._observer
        call_id = observer.begin(name, non_block)
        start = perf_counter()
        if non_block:  # ends in whichever thread completes it
            observation = Observation(observer, name, call_id, start)
            try:
                return self._send_call(
                    method, timeout, args, kwargs, True, unique_reply_rank, expected, observation
                )
            except BaseException as error:
                observation.end(error)
                raise
        result: list[Any] | Future[list[Any]]
        try:
            if self._inline and timeout is None and not self._host.table.calls:
                try:
                    result = [self._run_inline(method, args, kwargs)]
                except Exception as exc:  # every worker error becomes the caller's WorkerError
                    raise as_worker_error(expected[0], name, exc) from exc
            else:
                result = self._send_call(
                    method, timeout, args, kwargs, False, unique_reply_rank, expected
                )
        except BaseException as error:
            observer.finished(name, call_id, perf_counter() - start, error)
            raise
        observer.finished(name, call_id, perf_counter() - start, None)
        return result

    def execute_model(self, batch: Any, non_block: bool = False) -> Any:
        """Run one step on every worker; return the output rank's result (or a Future of it)."""
        if non_block:
            fut = self.collective_rpc(
                "execute_model", args=(batch,), unique_reply_rank=self.output_rank, non_block=True
            )
            return chain_future(fut, _first)
        return self.collective_rpc(
            "execute_model", args=(batch,), unique_reply_rank=self.output_rank
        )[0]

    # --- asyncio -------------------------------------------------------------------------

    async def collective_rpc_async(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        unique_reply_rank: int | None = None,
    ) -> list[Any]:
        """:meth:`collective_rpc` for asyncio: ``await`` it from any running event loop (from
        several loops in several threads at once, too); the loop is never blocked.

        The same call as ``collective_rpc(..., non_block=True)``, with the same rules and the
        same errors (:class:`WorkerError` with the worker's traceback, :class:`RPCTimeoutError`
        for ``timeout``, :class:`ExecutorFailedError` or :class:`ExecutorClosedError`). It is
        sent from a thread of the executor's, in the order the coroutines start (a send may
        wait for room in a transport's queue), and completes in submission order.

        Cancelling the await (``task.cancel()``, ``asyncio.wait_for``, ``asyncio.timeout``)
        never cancels a call that was sent: every rank runs it, so the ranks stay in step, and
        later calls get their own results. The awaiter gets :class:`asyncio.CancelledError`
        at once; the call completes in the background and its outcome is discarded (an error
        is logged at debug level on the ``executor_core`` logger). A call not yet sent when
        its await is cancelled is withdrawn: no rank runs it. To bound how long the workers
        may take, pass ``timeout``, not an asyncio timeout.
        """
        if self._host.closed or self._host.failure is not None:
            self._check_open()

        def send() -> Future[list[Any]]:
            return self.collective_rpc(
                method,
                timeout,
                args,
                kwargs,
                non_block=True,
                unique_reply_rank=unique_reply_rank,
            )

        return await self._async_sender().call(send)

    async def execute_model_async(self, batch: Any) -> Any:
        """:meth:`execute_model` for asyncio: ``await`` the output rank's result. Sent,
        ordered, cancelled and failed as :meth:`collective_rpc_async` is (cancelling the
        await never stops a step the workers have been sent)."""
        if self._host.closed or self._host.failure is not None:
            self._check_open()

        def send() -> Future[Any]:
            future: Future[Any] = self.execute_model(batch, non_block=True)
            return future

        return await self._async_sender().call(send)

    def _async_sender(self) -> AsyncSender:
        """The sender of asyncio calls, started on the first one (stopped by shutdown)."""
        sender = self._aio
        if sender is not None:
            return sender
        host = self._host
        with host.state_lock:
            if host.closed:
                raise ExecutorClosedError("the executor has been shut down; create a new one")
            sender = self._aio
            if sender is None:
                from ._aio import AsyncSender  # deferred: asyncio loads for asyncio callers only

                sender = self._aio = AsyncSender(f"executor-{host.name}-asyncio")
                # Holds the sender, never the executor: a dropped executor stops its thread.
                weakref.finalize(self, sender.close)
        return sender

    # --- for subclasses ----------------------------------------------------------------

    def _resolve_timeout(self, timeout: float | None) -> float | None:
        """``timeout`` if given, else the config's ``rpc_timeout``; validated."""
        if timeout is None:
            return self.config.rpc_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ValueError(f"timeout must be a number of seconds > 0 or None, not {timeout!r}")
        return float(timeout)

    def _check_reply_rank(self, unique_reply_rank: int | None) -> None:
        if unique_reply_rank is not None and not (
            type(unique_reply_rank) is int and 0 <= unique_reply_rank < self.world_size
        ):
            raise ValueError(
                f"unique_reply_rank={unique_reply_rank!r} is not a rank of this executor "
                f"(0..{self.world_size - 1})"
            )

    def _check_open(self) -> None:
        """Raise if the executor is closed or has failed."""
        host = self._host
        if host.closed:
            raise ExecutorClosedError("the executor has been shut down; create a new one")
        failure = host.failure
        if failure is not None:
            raise failure

    @property
    def _send_lock(self) -> threading.Lock:
        """Held while a call is sent (for a subclass that must wait for sends to stop)."""
        return self._host.send_lock

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

    @property
    def is_sleeping(self) -> bool:
        """True while any of :data:`SLEEP_TAGS` is asleep."""
        return bool(self._sleeping_tags)

    @property
    def sleeping_tags(self) -> frozenset[str]:
        """The tags that are asleep now."""
        return frozenset(self._sleeping_tags)

    def sleep(self, level: int = 1) -> None:
        """Release the workers' memory (level 1: offload weights, drop caches; level 2: drop
        both). Does nothing if already asleep."""
        if level not in (1, 2):
            raise SleepStateError(f"sleep level must be 1 or 2, not {level!r}")
        self._check_open()
        if self._sleeping_tags:
            return
        self.collective_rpc("sleep", kwargs={"level": level})
        self._sleeping_tags = set(SLEEP_TAGS)
        notify_sleep(self.registry.hook, self._host.name, frozenset(self._sleeping_tags))

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Restore what :meth:`sleep` released: everything, or only ``tags``."""
        self._check_open()
        if tags is None:
            wanted = sorted(self._sleeping_tags)
        else:
            if isinstance(tags, str):
                raise SleepStateError(f"tags must be a list of tags, not the string {tags!r}")
            wanted = list(dict.fromkeys(tags))
            unknown = [t for t in wanted if t not in SLEEP_TAGS]
            if unknown:
                raise SleepStateError(f"unknown sleep tags {unknown}; known: {list(SLEEP_TAGS)}")
            awake = [t for t in wanted if t not in self._sleeping_tags]
            if awake:
                raise SleepStateError(
                    f"cannot wake {awake}: not asleep "
                    f"(asleep now: {sorted(self._sleeping_tags) or 'nothing'})"
                )
        if not wanted:
            return
        self.collective_rpc("wake_up", kwargs={"tags": wanted})
        self._sleeping_tags.difference_update(wanted)
        notify_sleep(self.registry.hook, self._host.name, frozenset(self._sleeping_tags))

    def check_health(self) -> None:
        """Raise if the executor or any worker is unhealthy."""
        self._check_open()
        self.collective_rpc("check_health")

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
            sender = self._aio
        # Graceful only if no send is stuck: the stop must not interleave with a call.
        graceful = host.failure is None and host.send_lock.acquire(timeout=_SEND_LOCK_S)
        try:
            host.release(graceful)
        finally:
            if graceful:
                host.send_lock.release()
            self._finalizer.detach()
            if sender is not None:  # after the release: a send it waits on has ended
                sender.close()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def _first(results: Sequence[Any]) -> Any:
    return results[0]


def _no_inline_runner(*_args: Any) -> Any:
    raise AssertionError("the transport has no inline runner")  # never called: see _inline


def _spec_of(registry: Registry, cls: type[Executor]) -> BackendSpec | None:
    """The declared backend whose executor is ``cls`` (None for a class no plugin declares)."""
    qualname = f"{cls.__module__}:{cls.__qualname__}"
    for spec in registry.backends():
        if spec.executor == qualname:
            return spec
    return None


def _as_args(args: Any) -> tuple[Any, ...]:
    if isinstance(args, list | tuple):
        return tuple(args)
    raise TypeError(f"args must be a tuple of positional arguments, not {type(args).__name__}")


def _check_backend_options(cls: type[Executor], config: ExecutorConfig, name: str) -> None:
    """Refuse ``backend_options`` keys and values the backend's ``options_cls`` does not take."""
    options_cls = cls.options_cls
    if not (isinstance(options_cls, type) and attrs.has(options_cls)):
        raise TypeError(
            f"{cls.__qualname__}.options_cls must be an attrs class of the backend_options it "
            f"takes, not {options_cls!r} (see executor_core.options)"
        )
    parse_backend_options(options_cls, config.backend_options, name)


def _check_capabilities(spec: BackendSpec, config: ExecutorConfig) -> None:
    """Refuse a config the backend does not declare it can run (before starting anything)."""
    caps = spec.capabilities
    if config.pipeline_parallel_size > 1 and not caps.pipeline_parallel:
        raise ExecutorError(
            f"the {spec.name!r} backend does not support pipeline parallelism "
            f"(pipeline_parallel_size={config.pipeline_parallel_size}); "
            "choose a backend that does, such as 'mp' or 'ray'"
        )
    if config.num_nodes > 1 and not caps.multi_node:
        raise ExecutorError(
            f"the {spec.name!r} backend runs on one node, but num_nodes={config.num_nodes}; "
            "choose a multi-node backend such as 'ray'"
        )
    max_world_size = caps.max_world_size
    if max_world_size is not None and config.world_size > max_world_size:
        raise ExecutorError(
            f"the {spec.name!r} backend runs at most {max_world_size} worker(s), but "
            f"world_size={config.world_size}; use backend='mp' (one machine) or 'ray' (a cluster)"
        )
    if config.device not in caps.devices:
        raise ConfigError(
            "device",
            config.device,
            f"the {spec.name!r} backend drives {'/'.join(caps.devices)}",
        )


def _check_executor_class(obj: object, origin: str) -> type[Executor]:
    if isinstance(obj, type) and issubclass(obj, Executor):
        return obj
    raise BackendLoadError(f"{origin} is not an Executor subclass (got {obj!r})")


def create_executor(config: ExecutorConfig, registry: Registry | None = None) -> Executor:
    """Resolve ``config.backend`` and return a started executor, ready for calls."""
    cls = Executor.get_class(config, registry)
    return cls(config, registry=registry)
