"""Executor: the users' object, which takes every call to the workers along one path."""

from __future__ import annotations

import functools
import math
import operator
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from time import perf_counter
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self, TypeVar, cast, overload

import attrs

from ._aio import AsyncSender
from ._calls import Call, as_worker_error
from ._config import ExecutorConfig, ExecutorState, RecoveryRecord
from ._errors import (
    BackendLoadError,
    ConfigError,
    ExecutorError,
    ExecutorFailedError,
    RecoveringError,
    RPCTimeoutError,
    SleepStateError,
    WorkerDiedError,
)
from ._hooks import CallObserver
from ._recovery import FailureCallback, Recovery
from ._registry import BackendSpec, Registry, default_registry, resolve_qualname
from ._worker import SLEEP_TAGS
from ._wrapper import method_name
from .options import NoOptions, parse_backend_options

if TYPE_CHECKING:
    from attrs import AttrsInstance

    from ._transport import Transport, TransportHost

__all__ = ["Executor", "FailureCallback", "chain_future", "create_executor", "executor_class"]

T = TypeVar("T")
U = TypeVar("U")


def chain_future(source: Future[T], transform: Callable[[T], U]) -> Future[U]:
    """A future that completes with ``transform(source.result())`` (or source's exception)."""
    target: Future[U] = Future()
    target.set_running_or_notify_cancel()

    def done(fut: Future[T]) -> None:
        try:
            target.set_result(transform(fut.result()))
        except BaseException as err:  # noqa: BLE001 - the source's, or transform's: the caller's
            target.set_exception(err)

    source.add_done_callback(done)
    return target


class Executor:
    """Runs a model's workers, one per rank, and drives them all through one object.

    Every rule of a call is the core's, written once for every backend: validation, one
    order of calls for all ranks whatever the number of calling threads, timeouts,
    ``unique_reply_rank``, reply and failure gathering (the lowest failing rank wins), the
    calls in flight failed on a death, on :meth:`fail` and on :meth:`shutdown`, failure
    callbacks, recovery, sleep state, and cleanup (also when the executor is dropped without
    :meth:`shutdown`). A backend subclasses it only to name its :class:`Transport`
    (``transport_cls``) and its options (``options_cls``); see ``executor_core.backend``.
    """

    #: The backend's transport class: how workers start and stop and how calls reach them.
    transport_cls: ClassVar[type[Transport]]
    #: The backend's options: an attrs class whose fields are the ``backend_options`` keys it
    #: takes (see ``executor_core.options``); the core refuses any other key, and a bad
    #: value, before the transport is built. The default takes none.
    options_cls: ClassVar[type[AttrsInstance]] = NoOptions

    @staticmethod
    def get_class(config: ExecutorConfig, registry: Registry | None = None) -> type[Executor]:
        """The Executor subclass for ``config.backend`` (see :func:`executor_class`)."""
        return executor_class(config, registry)

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
        name, spec = self._admit(spec)
        hooks = self.registry.hook
        self._observer = CallObserver(hooks, name, config.world_size)
        self._observed = self._observer.impls
        self._recovery = recovery = Recovery(cls, config, name, hooks)
        if spec is not None:
            recovery.replaces = spec.capabilities.recovery == "replace"
        #: Sends the asyncio calls from its own thread (started on the first one).
        self._aio = AsyncSender(f"executor-{name}-asyncio")
        # The finalizer holds the recovery (which holds no executor): a dropped executor is
        # collected, and what it left running is stopped by force.
        self._finalizer = weakref.finalize(self, _drop, recovery, self._aio)
        recovery.install(first=True)

    @classmethod
    def _create_transport(cls, host: TransportHost) -> Transport:
        """Build the transport over ``host`` (override to pass it more; a class method: it
        is called for each incarnation of the workers, and never holds the executor)."""
        return cls.transport_cls(host)

    def _admit(self, spec: BackendSpec | None) -> tuple[str, BackendSpec | None]:
        """Refuse, before anything starts, a config the backend does not declare it can run
        (its spec's capabilities) or options its ``options_cls`` does not take; the name."""
        cls, config = type(self), self.config
        if spec is None:
            qualname = f"{cls.__module__}:{cls.__qualname__}"
            spec = next((s for s in self.registry.backends() if s.executor == qualname), None)
        name = spec.name if spec is not None else cls.__qualname__
        if spec is not None:
            refused = _refusal(spec, config)
            if refused is not None:
                raise refused
        options_cls = cls.options_cls
        if not (isinstance(options_cls, type) and attrs.has(options_cls)):
            raise TypeError(
                f"{cls.__qualname__}.options_cls must be an attrs class of the backend_options it "
                f"takes, not {options_cls!r} (see executor_core.options)"
            )
        parse_backend_options(options_cls, config.backend_options, name)
        return name, spec

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
        if type(method) is not str and not callable(method):
            raise TypeError(
                "method must be a worker method name or a callable taking the worker, "
                f"not {type(method).__name__}"
            )
        if type(args) is not tuple:
            if not isinstance(args, list | tuple):
                raise TypeError(
                    f"args must be a tuple of positional arguments, not {type(args).__name__}"
                )
            args = tuple(args)
        if kwargs is not None and type(kwargs) is not dict:
            raise TypeError(f"kwargs must be a dict or None, not {type(kwargs).__name__}")
        expected = self._recovery.ranks
        if unique_reply_rank is not None:
            if not (type(unique_reply_rank) is int and 0 <= unique_reply_rank < self.world_size):
                raise ValueError(
                    f"unique_reply_rank={unique_reply_rank!r} is not a rank of this executor "
                    f"(0..{self.world_size - 1})"
                )
            if unique_reply_rank in expected:
                expected = (unique_reply_rank,)
            else:  # a rank this transport does not drive (SPMD): its own ranks answer
                unique_reply_rank = None
        return self._call(method, timeout, args, kwargs, non_block, unique_reply_rank, expected)

    def _call(
        self,
        method: str | Callable[..., Any],
        timeout: float | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        non_block: bool,
        reply_rank: int | None,
        expected: tuple[int, ...],
    ) -> list[Any] | Future[list[Any]]:
        """The one path of every validated call: wait out a recovery, apply the default
        timeout, then a plain method call where the transport runs one rank inline, else send
        it to every rank and wait for it (unless ``non_block``), between the observer hooks
        if a plugin implements them."""
        recovery = self._recovery
        host = recovery.host
        if host._closed or host._failure is not None or host._table.closed_error is not None:
            timeout = self._await_recovery(timeout, method)
            host = recovery.host
        if timeout is not None or self.config.rpc_timeout is not None:
            timeout = self._resolve_timeout(timeout)
        started, finished = self._observed
        observed = started or finished  # truthy while a plugin observes calls
        if observed:
            observer = self._observer
            name = method_name(method)
            call_id, start = observer.started(name, non_block), perf_counter()
        table = host._table
        try:
            run_inline = recovery.run_inline
            if run_inline is not None and timeout is None and not non_block and not table.calls:
                # One rank in this process, nothing in flight: a plain method call. No send
                # lock: with a single rank, calls from several threads have no order to keep.
                try:
                    result: Any = [run_inline(method, args, kwargs)]
                except Exception as exc:  # every worker error is the caller's WorkerError
                    raise as_worker_error(expected[0], method_name(method), exc) from exc
            else:
                future: Future[list[Any]] | None = None
                on_done = None
                if non_block:
                    future = Future()
                    future.set_running_or_notify_cancel()
                    if observed:  # the call's end, in whichever thread completes it
                        on_done = functools.partial(observer.finished, name, call_id, start)
                call = Call(
                    seq=0,
                    method=method,
                    name=method_name(method),
                    args=args,
                    kwargs=kwargs,
                    reply_rank=reply_rank,
                    expected=expected,
                    timeout=timeout,
                    future=future,
                    on_done=on_done,
                )
                self._send(host, call)
                assert recovery.replies is not None
                if future is not None:
                    recovery.replies.ensure_pump(call)
                    return future
                result = recovery.replies.wait(call)
        except BaseException as error:
            if observed:
                observer.finished(name, call_id, start, error)
            raise
        if observed:
            observer.finished(name, call_id, start, None)
        return result  # type: ignore[no-any-return]  # the list, by construction

    def _send(self, host: TransportHost, call: Call) -> None:
        """Give ``call`` its sequence number and send it, under the send lock."""
        recovery, table = self._recovery, host._table
        with host._send_lock:
            host._check_open()
            call.seq = recovery.next_seq
            recovery.next_seq += 1
            table.add(call)
            try:
                sent = recovery.transport.send(call)  # type: ignore[union-attr]  # started
            except Exception:
                table.remove(call)
                if table.closed_error is not None:  # it gave up because the executor closed
                    raise table.closed_error from None
                raise
            except BaseException:  # Ctrl-C: the caller's own interruption goes through
                table.remove(call)
                raise
            if not sent:
                table.remove(call)
                if table.closed_error is not None:
                    raise table.closed_error
                error = RPCTimeoutError(call.name, list(recovery.ranks), call.timeout or 0.0)
                if call.future is None:
                    raise error
                call.finish(False, error)

    def execute_model(self, batch: Any, non_block: bool = False) -> Any:
        """Run one step on every worker; return the output rank's result (or a Future of it)."""
        reply_rank, expected = self._recovery.step_reply
        result = self._call("execute_model", None, (batch,), None, non_block, reply_rank, expected)
        if non_block:
            return chain_future(cast("Future[list[Any]]", result), operator.itemgetter(0))
        return cast("list[Any]", result)[0]

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
        same errors. It is sent from a thread of the executor's, in the order the coroutines
        start (a call made during a recovery waits there, not on the loop), and completes in
        submission order. Cancelling the await never cancels a call
        that was sent: every rank runs it, so the ranks stay in step, and its outcome is
        discarded (an error is logged at debug level); a call not yet sent is withdrawn. To
        bound how long the workers may take, pass ``timeout``, not an asyncio timeout.
        """
        return await self._aio.call(
            lambda: self.collective_rpc(
                method, timeout, args, kwargs, non_block=True, unique_reply_rank=unique_reply_rank
            )
        )

    async def execute_model_async(self, batch: Any) -> Any:
        """:meth:`execute_model` for asyncio: ``await`` the output rank's result (sent,
        ordered, cancelled and failed as :meth:`collective_rpc_async` is)."""
        return await self._aio.call(lambda: self.execute_model(batch, non_block=True))

    def _await_recovery(
        self, timeout: float | None, method: str | Callable[..., Any]
    ) -> float | None:
        """A call found the executor failed or closed: raise why, or, while a recovery runs and
        the policy says calls wait, wait for it; return what is left of ``timeout``."""
        recovery = self._recovery
        policy, host = recovery.policy, recovery.host
        if not host._closed and policy is not None and recovery.state is ExecutorState.RECOVERING:
            if not policy.wait_calls:
                raise RecoveringError(recovery.recovering_ranks)
            timeout = self._resolve_timeout(timeout)
            start = perf_counter()
            state = recovery.wait(timeout)
            left = None if timeout is None else timeout - (perf_counter() - start)
            if state is ExecutorState.RUNNING and (left is None or left > 0):
                return left
            if state in (ExecutorState.RECOVERING, ExecutorState.RUNNING):
                raise RPCTimeoutError(method_name(method), list(recovery.ranks), timeout or 0.0)
        if recovery.final is not None and not recovery.host._closed:
            raise recovery.final
        recovery.host._check_open()
        return timeout

    def _resolve_timeout(self, timeout: float | None) -> float | None:
        """``timeout`` if given, else the config's ``rpc_timeout``; validated."""
        if timeout is None:
            return self.config.rpc_timeout
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout < math.inf
        ):
            raise ValueError(
                f"timeout must be a finite number of seconds > 0, or None (no bound), "
                f"not {timeout!r}"
            )
        return float(timeout)

    # --- sleep and health ----------------------------------------------------------------------

    @property
    def is_sleeping(self) -> bool:
        """True while any of :data:`SLEEP_TAGS` is asleep."""
        return bool(self._recovery.sleeping)

    @property
    def sleeping_tags(self) -> frozenset[str]:
        """The tags that are asleep now."""
        return frozenset(self._recovery.sleeping)

    def sleep(self, level: int = 1) -> None:
        """Release the workers' memory (level 1: offload weights, drop caches; level 2: drop
        both). Does nothing if already asleep."""
        if level not in (1, 2):
            raise SleepStateError(f"sleep level must be 1 or 2, not {level!r}")
        self._recovery.host._check_open()
        if self._recovery.sleeping:
            return
        self.collective_rpc("sleep", kwargs={"level": level})
        self._sleep_changed(set(SLEEP_TAGS))

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Restore what :meth:`sleep` released: everything, or only ``tags``; a tag that is
        unknown or awake already is refused."""
        self._recovery.host._check_open()
        asleep = self._recovery.sleeping
        if tags is None:
            wanted = sorted(asleep)
        else:
            if isinstance(tags, str):
                raise SleepStateError(f"tags must be a list of tags, not the string {tags!r}")
            wanted = list(dict.fromkeys(tags))
            unknown = [t for t in wanted if t not in SLEEP_TAGS]
            if unknown:
                raise SleepStateError(f"unknown sleep tags {unknown}; known: {list(SLEEP_TAGS)}")
            awake = [t for t in wanted if t not in asleep]
            if awake:
                raise SleepStateError(
                    f"cannot wake {awake}: not asleep (asleep now: {sorted(asleep) or 'nothing'})"
                )
        if wanted:
            self.collective_rpc("wake_up", kwargs={"tags": wanted})
            self._sleep_changed(asleep - set(wanted))

    def _sleep_changed(self, tags: set[str]) -> None:
        self._recovery.sleeping = tags
        self._observer.sleep_changed(frozenset(tags))

    def check_health(self) -> None:
        """Raise if the executor or any worker is unhealthy."""
        self.collective_rpc("check_health")

    # --- state -------------------------------------------------------------------------------

    @property
    def registry(self) -> Registry:
        """The plugin registry this executor was created from (the default one otherwise)."""
        if self._registry is None:
            self._registry = default_registry()
        return self._registry

    @property
    def transport(self) -> Transport:
        """The backend's transport (for a backend's own extras)."""
        transport = self._recovery.transport
        assert transport is not None  # started in __init__
        return transport

    @property
    def backend_name(self) -> str:
        """The backend's name (as workers see it in ``WorkerContext.backend``)."""
        return self._recovery.name

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
        return self._recovery.host._closed

    @property
    def state(self) -> ExecutorState:
        """Running, recovering (workers died and are being started again), failed for good,
        or closed: see :class:`~executor_core.ExecutorState`."""
        recovery = self._recovery
        state = recovery.state
        if state is ExecutorState.RUNNING and recovery.host._failure is not None:
            return ExecutorState.FAILED if recovery.policy is None else state
        return state

    @property
    def last_recovery(self) -> RecoveryRecord | None:
        """What the last completed recovery did (which ranks died, which got new processes,
        how long it took, why), or None if none completed."""
        return self._recovery.last

    @property
    def last_death(self) -> WorkerDiedError | None:
        """The death the executor is recovering from, or last recovered from (None if none)."""
        return self._recovery.last_death

    @property
    def is_failed(self) -> bool:
        """True once the executor has failed for good: with a recovery policy, not while it
        recovers (see :meth:`register_failure_callback`)."""
        return self.failure is not None

    @property
    def failure(self) -> ExecutorFailedError | None:
        """The error the executor failed with for good, if it has."""
        recovery = self._recovery
        if recovery.policy is None:
            return recovery.host._failure
        return recovery.final if recovery.state is ExecutorState.FAILED else None

    def register_failure_callback(self, callback: FailureCallback) -> None:
        """Call ``callback(error)`` once if the executor fails for good (at once if it has).
        It runs before the calls in flight raise the failure. A death that a recovery policy
        brings the executor back from is not a failure (``executor_recovery_started``
        reports it)."""
        self._recovery.register(callback)

    def fail(self, error: ExecutorFailedError) -> bool:
        """Mark the executor failed with ``error``: every call in flight and every later call
        raises it, and the failure callbacks run, once; no recovery policy brings it back
        (:meth:`recover` may). Returns False if it had already failed (or was shut down)."""
        if not isinstance(error, ExecutorFailedError):
            raise TypeError(f"error must be an ExecutorFailedError, not {type(error).__name__}")
        recovery = self._recovery
        recovery.refuse_next = True
        failed = recovery.host._fail(error)
        if not failed:
            recovery.refuse_next = False
        return failed

    def recover(self, timeout: float | None = None) -> None:
        """Bring a failed executor back now: stop every worker and start them again (fresh
        contexts, ``init_device`` and ``load_model`` again), whatever the recovery policy
        says; wait for a recovery that runs already. Returns once calls reach the workers
        again; raises the error of a failed attempt (the executor is then failed). Calls in
        flight at the failure are never replayed: resubmit what you need."""
        self._recovery.recover(timeout)

    def shutdown(self) -> None:
        """Stop the workers (each runs its ``shutdown``) and release every resource; calls in
        flight raise :class:`ExecutorClosedError`. Idempotent."""
        self._recovery.shutdown()
        self._finalizer.detach()
        self._aio.close()  # after the release: a send it waits on has ended

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def _drop(recovery: Recovery, aio: AsyncSender) -> None:
    """An executor dropped without ``shutdown()``: stop its workers by force."""
    recovery.drop()
    aio.close()


def _refusal(spec: BackendSpec, config: ExecutorConfig) -> ExecutorError | None:
    """Why the backend cannot run ``config``, as its spec declares, or None."""
    caps, name = spec.capabilities, spec.name
    if config.pipeline_parallel_size > 1 and not caps.pipeline_parallel:
        return ExecutorError(
            f"the {name!r} backend does not support pipeline parallelism (pipeline_parallel_size="
            f"{config.pipeline_parallel_size}); choose a backend that does, such as 'mp' or 'ray'"
        )
    if config.num_nodes > 1 and not caps.multi_node:
        return ExecutorError(
            f"the {name!r} backend runs on one node, but num_nodes={config.num_nodes}; "
            "choose a multi-node backend such as 'ray'"
        )
    if caps.max_world_size is not None and config.world_size > caps.max_world_size:
        return ExecutorError(
            f"the {name!r} backend runs at most {caps.max_world_size} worker(s), but "
            f"world_size={config.world_size}; use backend='mp' (one machine) or 'ray' (a cluster)"
        )
    if config.recovery is not None and caps.recovery == "none":
        return ConfigError(
            "recovery",
            config.recovery,
            f"the {name!r} backend cannot start its workers again in this process (its spec "
            "declares Capabilities(recovery='none')); leave recovery=None, or choose a backend "
            "that recovers, such as 'mp' or 'ray'",
        )
    if config.hang_timeout_s is not None and not caps.liveness_probe:
        return ConfigError(
            "hang_timeout_s",
            config.hang_timeout_s,
            f"the {name!r} backend cannot tell whether a rank's process still answers (its spec "
            "declares Capabilities(liveness_probe=False)); leave hang_timeout_s=None, or choose "
            "a backend with a probe, such as 'mp'",
        )
    if config.device not in caps.devices:
        return ConfigError(
            "device", config.device, f"the {name!r} backend drives {'/'.join(caps.devices)}"
        )
    return None


def executor_class(config: ExecutorConfig, registry: Registry | None = None) -> type[Executor]:
    """The Executor subclass for ``config.backend``: an Executor subclass or a
    ``"package.module:Class"`` string bypasses discovery; a name, an alias or ``"auto"`` is
    resolved through the plugin registry (the default one unless ``registry`` is given)."""
    backend = config.backend
    if isinstance(backend, str) and ":" not in backend:
        registry = registry or default_registry()
        spec = registry.get(registry.resolve_name(config))
        cls = registry.load_executor(spec.name)
        if isinstance(cls, type) and issubclass(cls, Executor):
            return cls
        raise BackendLoadError(
            f"backend {spec.name!r}: {spec.executor!r} is not an Executor subclass; a backend "
            "names its Executor subclass as 'package.module:Class' (see docs/writing-a-backend.md)"
        )
    obj: Any = backend
    if isinstance(backend, str):
        try:
            obj = resolve_qualname(backend)
        except ImportError as exc:
            raise BackendLoadError(f"cannot import executor class {backend!r}: {exc}") from exc
    if isinstance(obj, type) and issubclass(obj, Executor):
        return obj
    origin = backend if isinstance(backend, str) else repr(backend)
    raise BackendLoadError(f"{origin} is not an Executor subclass (got {obj!r})")


def create_executor(config: ExecutorConfig, registry: Registry | None = None) -> Executor:
    """Resolve ``config.backend`` and return a started executor, ready for calls."""
    return executor_class(config, registry)(config, registry=registry)
