"""Executor: the users' object, which takes every call to the workers along one path."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from time import perf_counter
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast, overload

from ._calls import Call, as_worker_error
from ._config import ExecutorConfig
from ._errors import RecoveringError, RPCTimeoutError
from ._lifecycle import FailureCallback, Lifecycle
from ._observe import Observation
from ._recovery_policy import ExecutorState
from ._resolve import executor_class
from ._wire import method_name

if TYPE_CHECKING:
    from ._registry import Registry

__all__ = ["Executor", "FailureCallback", "chain_future", "create_executor"]


T = TypeVar("T")
U = TypeVar("U")


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


class Executor(Lifecycle):
    """Runs a model's workers, one per rank, and drives them all through one object.

    Every rule of a call is the core's, written once for every backend: validation, one order
    of calls for all ranks whatever the number of calling threads, timeouts on blocking and
    non-blocking calls, ``unique_reply_rank``, reply and failure gathering (the lowest failing
    rank wins), failing the calls in flight on a worker's death, on :meth:`fail` and on
    :meth:`shutdown`, failure callbacks, sleep state, and cleanup (also when the executor is
    dropped without :meth:`shutdown`). Calls have asyncio forms too
    (:meth:`collective_rpc_async`, :meth:`execute_model_async`). A backend subclasses it only
    to name its :class:`Transport` (``transport_cls``) and its options (``options_cls``), and
    to add extras of its own; see ``executor_core.backend``.
    """

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
        return self._submit(method, timeout, args, kwargs, non_block, unique_reply_rank, expected)

    def _submit(
        self,
        method: str | Callable[..., Any],
        timeout: float | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        non_block: bool,
        reply_rank: int | None,
        expected: tuple[int, ...],
    ) -> list[Any] | Future[list[Any]]:
        """A validated call (:meth:`collective_rpc`'s, or :meth:`execute_model`'s, valid by
        construction): wait out a recovery, apply the default timeout, then :meth:`_call`,
        between the driver's observer hooks if a plugin implements one."""
        host = self._host
        if host.closed or host.failure is not None or host.table.closed_error is not None:
            timeout = self._await_recovery(host, timeout, method)
        if timeout is not None or self._default_timeout is not None:
            timeout = self._resolve_timeout(timeout)
        if not (self._calls_started or self._calls_finished):  # no plugin observes calls
            return self._call(None, method, timeout, args, kwargs, non_block, reply_rank, expected)
        # Between the started and finished hooks. A non-blocking call's Observation ends when
        # the call completes (or here, if its send raises).
        name = method if type(method) is str else method_name(method)
        observer = self._observer
        call_id = observer.begin(name, non_block)
        start = perf_counter()
        if non_block:
            observation = Observation(observer, name, call_id, start)
            try:
                return self._call(
                    observation, method, timeout, args, kwargs, True, reply_rank, expected
                )
            except BaseException as error:
                observation.end(error)
                raise
        try:
            result = self._call(None, method, timeout, args, kwargs, False, reply_rank, expected)
        except BaseException as error:
            observer.finished(name, call_id, perf_counter() - start, error)
            raise
        observer.finished(name, call_id, perf_counter() - start, None)
        return result

    def _call(
        self,
        observation: Observation | None,
        method: str | Callable[..., Any],
        timeout: float | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        non_block: bool,
        reply_rank: int | None,
        expected: tuple[int, ...],
    ) -> list[Any] | Future[list[Any]]:
        """The one path of every call :meth:`collective_rpc` validated, observed or not: a
        plain method call where the transport runs one rank inline, else sent to every rank
        and waited for (unless ``non_block``). ``observation``: an observed non-blocking
        call's, ended when the call completes (else None)."""
        run_inline = self._run_inline
        host = self._host
        if run_inline is not None and timeout is None and not non_block and not host.table.calls:
            # One rank, in this process, nothing in flight: a plain method call. No send lock:
            # with a single rank, calls from several threads have no order to disagree on.
            try:
                return [run_inline(method, args, kwargs)]
            except Exception as exc:  # every worker error becomes the caller's WorkerError
                raise as_worker_error(expected[0], method_name(method), exc) from exc
        table = host.table
        name = method_name(method)
        future: Future[list[Any]] | None = None
        if non_block:
            future = Future()
            future.set_running_or_notify_cancel()
        with host.send_lock:
            if host.closed:
                host.check_open()
            seq = self._next_seq
            self._next_seq = seq + 1
            call = Call(
                seq=seq,
                method=method,
                name=name,
                args=args,
                kwargs=kwargs,
                reply_rank=reply_rank,
                expected=expected,
                timeout=timeout,
                future=future,
                observation=observation,
            )
            table.add(call)
            try:
                sent = self._transport.send(call)
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
            self._replies.ensure_pump(call)
            return future
        return self._replies.wait(call)

    def execute_model(self, batch: Any, non_block: bool = False) -> Any:
        """Run one step on every worker; return the output rank's result (or a Future of it)."""
        reply_rank, expected = self._step_reply
        if non_block:
            fut = self._submit("execute_model", None, (batch,), None, True, reply_rank, expected)
            return chain_future(cast("Future[list[Any]]", fut), _first)
        result = self._submit("execute_model", None, (batch,), None, False, reply_rank, expected)
        return cast("list[Any]", result)[0]

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
        host = self._host
        if host.closed or host.failure is not None or host.table.closed_error is not None:
            timeout = self._await_recovery(host, timeout, method)
        return await self._aio.call(
            lambda: self.collective_rpc(
                method, timeout, args, kwargs, non_block=True, unique_reply_rank=unique_reply_rank
            )
        )

    async def execute_model_async(self, batch: Any) -> Any:
        """:meth:`execute_model` for asyncio: ``await`` the output rank's result. Sent,
        ordered, cancelled and failed as :meth:`collective_rpc_async` is (cancelling the
        await never stops a step the workers have been sent)."""
        host = self._host
        if host.closed or host.failure is not None or host.table.closed_error is not None:
            self._await_recovery(host, None, "execute_model")
        return await self._aio.call(lambda: self.execute_model(batch, non_block=True))

    def _await_recovery(
        self, host: Any, timeout: float | None, method: str | Callable[..., Any]
    ) -> float | None:
        """A call found ``host`` failed or closed: raise why, or, while a recovery runs and
        the policy says calls wait, wait for it; return what is left of ``timeout``."""
        recovery = self._recovery
        policy = recovery.policy
        if not host.closed and policy is not None and recovery.state is ExecutorState.RECOVERING:
            if not policy.wait_calls:
                raise RecoveringError(recovery.recovering_ranks)
            timeout = self._resolve_timeout(timeout)
            start = perf_counter()
            state = recovery.wait(timeout)
            if state is ExecutorState.RUNNING:
                if timeout is None:
                    return None
                left = timeout - (perf_counter() - start)
                if left > 0:
                    return left
            if state in (ExecutorState.RECOVERING, ExecutorState.RUNNING):
                name = method if type(method) is str else method_name(method)
                raise RPCTimeoutError(name, list(self._all_ranks), timeout or 0.0)
        if recovery.final is not None and not host.closed:
            raise recovery.final
        self._host.check_open()
        return timeout

    # --- for subclasses ----------------------------------------------------------------

    def _resolve_timeout(self, timeout: float | None) -> float | None:
        """``timeout`` if given, else the config's ``rpc_timeout``; validated."""
        if timeout is None:
            return self.config.rpc_timeout
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout < math.inf  # NaN and infinity too: None is "no bound"
        ):
            raise ValueError(
                f"timeout must be a finite number of seconds > 0, or None (no bound), "
                f"not {timeout!r}"
            )
        return float(timeout)

    def _check_reply_rank(self, unique_reply_rank: int | None) -> None:
        if unique_reply_rank is not None and not (
            type(unique_reply_rank) is int and 0 <= unique_reply_rank < self.world_size
        ):
            raise ValueError(
                f"unique_reply_rank={unique_reply_rank!r} is not a rank of this executor "
                f"(0..{self.world_size - 1})"
            )

    @property
    def is_sleeping(self) -> bool:
        """True while any of :data:`SLEEP_TAGS` is asleep."""
        return bool(self._sleep.tags)

    @property
    def sleeping_tags(self) -> frozenset[str]:
        """The tags that are asleep now."""
        return frozenset(self._sleep.tags)

    def sleep(self, level: int = 1) -> None:
        """Release the workers' memory (level 1: offload weights, drop caches; level 2: drop
        both). Does nothing if already asleep."""
        self._sleep.sleep(level, self.collective_rpc)

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Restore what :meth:`sleep` released: everything, or only ``tags``."""
        self._sleep.wake_up(tags, self.collective_rpc)

    def check_health(self) -> None:
        """Raise if the executor or any worker is unhealthy."""
        self.collective_rpc("check_health")


def _first(results: Sequence[Any]) -> Any:
    return results[0]


def _as_args(args: Any) -> tuple[Any, ...]:
    if isinstance(args, list | tuple):
        return tuple(args)
    raise TypeError(f"args must be a tuple of positional arguments, not {type(args).__name__}")


def create_executor(config: ExecutorConfig, registry: Registry | None = None) -> Executor:
    """Resolve ``config.backend`` and return a started executor, ready for calls."""
    return executor_class(config, registry)(config, registry=registry)
