"""Executor: the abstract strategy every backend implements, with the state they all share."""

from __future__ import annotations

import abc
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar, overload

from ._config import ExecutorConfig
from ._errors import (
    BackendLoadError,
    ExecutorClosedError,
    ExecutorError,
    ExecutorFailedError,
    SleepStateError,
)
from ._qualname import resolve_qualname
from ._worker import SLEEP_TAGS

if TYPE_CHECKING:
    from ._registry import Registry

__all__ = ["Executor", "FailureCallback", "chain_future", "create_executor"]


def _log_exception(message: str, *args: object) -> None:
    # logging is imported on this error path only: it costs ~20 ms at import time here.
    import logging

    logging.getLogger("executor_core").exception(message, *args)


T = TypeVar("T")
U = TypeVar("U")

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


class _Cleanups:
    """Resource releasers that must run once, from shutdown or from the finalizer.

    Kept apart from the executor so that the finalizer holds no reference to it.
    """

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


class Executor(abc.ABC):
    """The strategy that runs a model's workers: in-process, in processes, or on a cluster.

    Subclasses implement :meth:`_init_executor`, :meth:`collective_rpc` and
    :meth:`_shutdown_workers`; this class keeps the shared state: closed/failed, failure
    callbacks, sleep tags, the finalizer and the context manager.
    """

    #: True if the backend runs pipeline-parallel stages.
    supports_pp: ClassVar[bool] = False
    #: True if the backend's workers are Ray actors.
    uses_ray: ClassVar[bool] = False

    def __init__(self, config: ExecutorConfig, *, registry: Registry | None = None) -> None:
        if not isinstance(config, ExecutorConfig):
            raise TypeError(f"config must be an ExecutorConfig, not {type(config).__name__}")
        if config.pipeline_parallel_size > 1 and not self.supports_pp:
            raise ExecutorError(
                f"{type(self).__name__} does not support pipeline parallelism "
                f"(pipeline_parallel_size={config.pipeline_parallel_size}); "
                "choose a backend that does, such as 'mp' or 'ray'"
            )
        self.config = config
        self._registry = registry
        self._state_lock = threading.Lock()
        self._closed = False
        self._failure: ExecutorFailedError | None = None
        self._failure_callbacks: list[FailureCallback] = []
        self._sleeping_tags: set[str] = set()
        self._cleanups = _Cleanups()
        self._finalizer = weakref.finalize(self, self._cleanups.run)
        try:
            self._init_executor()
        except BaseException:
            self._closed = True
            try:
                self._shutdown_workers()
            finally:
                self._finalizer()
            raise

    # --- resolving and creating ----------------------------------------------------------

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

    # --- to implement --------------------------------------------------------------------

    @abc.abstractmethod
    def _init_executor(self) -> None:
        """Start the workers and wait until each has run ``init_device`` and ``load_model``.

        On error, raise; :meth:`_shutdown_workers` and the registered cleanups then run.
        """

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

    @abc.abstractmethod
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
        With ``unique_reply_rank`` only that rank's result is returned (a one-item list).
        With ``non_block=True`` a :class:`~concurrent.futures.Future` of the list is returned;
        futures complete in submission order. ``timeout`` (seconds, default
        ``config.rpc_timeout``) raises :class:`RPCTimeoutError` naming the ranks that did not
        answer. A worker exception raises :class:`WorkerError`; the executor stays usable.
        """

    def _shutdown_workers(self) -> None:  # noqa: B027 - optional hook, empty by default
        """Stop the workers: graceful first, then forceful. Must be safe to call twice."""

    # --- shared behaviour ----------------------------------------------------------------

    @property
    def registry(self) -> Registry:
        """The plugin registry this executor was created from (the default one otherwise)."""
        if self._registry is None:
            from ._registry import default_registry

            self._registry = default_registry()
        return self._registry

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
        return self._closed

    @property
    def is_failed(self) -> bool:
        """True once the executor has failed (see :meth:`register_failure_callback`)."""
        return self._failure is not None

    @property
    def failure(self) -> ExecutorFailedError | None:
        """The error the executor failed with, if it has."""
        return self._failure

    def resolve_timeout(self, timeout: float | None) -> float | None:
        """``timeout`` if given, else the config's ``rpc_timeout``; validated."""
        if timeout is None:
            return self.config.rpc_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ValueError(f"timeout must be a number of seconds > 0 or None, not {timeout!r}")
        return float(timeout)

    def check_reply_rank(self, unique_reply_rank: int | None) -> None:
        """Raise ValueError if ``unique_reply_rank`` is not a valid rank."""
        if unique_reply_rank is not None and not (
            isinstance(unique_reply_rank, int) and 0 <= unique_reply_rank < self.world_size
        ):
            raise ValueError(
                f"unique_reply_rank={unique_reply_rank!r} is not a rank of this executor "
                f"(0..{self.world_size - 1})"
            )

    def check_open(self) -> None:
        """Raise if the executor is closed or has failed."""
        if self._closed:
            raise ExecutorClosedError("the executor has been shut down; create a new one")
        failure = self._failure
        if failure is not None:
            raise failure

    def add_cleanup(self, callback: Callable[[], None]) -> None:
        """Register a resource releaser run once at shutdown or by the finalizer (last in, first
        out). It must not reference the executor, or the finalizer can never run."""
        self._cleanups.add(callback)

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
        self.check_open()
        if self._sleeping_tags:
            return
        self.collective_rpc("sleep", kwargs={"level": level})
        self._sleeping_tags = set(SLEEP_TAGS)

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Restore what :meth:`sleep` released: everything, or only ``tags``."""
        self.check_open()
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

    def check_health(self) -> None:
        """Raise if the executor or any worker is unhealthy."""
        self.check_open()
        self.collective_rpc("check_health")

    def register_failure_callback(self, callback: FailureCallback) -> None:
        """Call ``callback(error)`` once if the executor fails (at once if it already has)."""
        with self._state_lock:
            failure = self._failure
            if failure is None:
                self._failure_callbacks.append(callback)
                return
        _run_callback(callback, failure)

    def fail(self, error: ExecutorFailedError) -> bool:
        """Mark the executor failed with ``error`` and run the failure callbacks, once.

        Backends call this from their monitor. Returns False if it had already failed.
        """
        with self._state_lock:
            if self._failure is not None or self._closed:
                return False
            self._failure = error
            callbacks, self._failure_callbacks = self._failure_callbacks, []
        for callback in callbacks:
            _run_callback(callback, error)
        return True

    def shutdown(self) -> None:
        """Stop the workers and release every resource. Idempotent."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            self._failure_callbacks.clear()
        try:
            self._shutdown_workers()
        finally:
            self._finalizer()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def _first(results: Sequence[Any]) -> Any:
    return results[0]


def _run_callback(callback: FailureCallback, error: ExecutorFailedError) -> None:
    try:
        callback(error)
    except Exception:  # noqa: BLE001 - one bad callback must not stop the others; logged
        _log_exception("executor failure callback %r raised", callback)


def _check_executor_class(obj: object, origin: str) -> type[Executor]:
    if isinstance(obj, type) and issubclass(obj, Executor):
        return obj
    raise BackendLoadError(f"{origin} is not an Executor subclass (got {obj!r})")


def create_executor(config: ExecutorConfig, registry: Registry | None = None) -> Executor:
    """Resolve ``config.backend`` and return a started executor, ready for calls."""
    cls = Executor.get_class(config, registry)
    return cls(config, registry=registry)
