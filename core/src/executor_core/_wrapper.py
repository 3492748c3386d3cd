"""WorkerWrapper: hosts the user's worker inside a worker process (or in-process)."""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._hothook import HotHook
from ._qualname import resolve_qualname
from ._thread_device import ThreadDevice, capture_thread_device
from ._wire import REJOIN_METHOD, RemoteFailure, loads_method, method_name
from ._worker import WorkerBase, WorkerContext

if TYPE_CHECKING:
    import pluggy

__all__ = ["WorkerWrapper"]


class WorkerWrapper:
    """Builds the user's worker lazily, in the process that hosts it, and runs methods on it.

    A transport gets one per rank from :meth:`TransportHost.wrapper`, uses it in the process
    that hosts the worker (it pickles without its hooks; a worker process loads its own),
    calls :meth:`init_worker` once, :meth:`handle` for each call, and :meth:`shutdown` at the
    end. Worker-side plugin hooks are called here, so every backend gets them for free.
    """

    def __init__(
        self,
        worker_cls: type | str,
        worker_kwargs: Mapping[str, Any],
        context: WorkerContext,
        *,
        env: Mapping[str, str] | None = None,
        hooks: pluggy.HookRelay | None = None,
    ) -> None:
        self.worker_cls = worker_cls
        self.worker_kwargs = dict(worker_kwargs)
        self.context = context
        self.env = dict(env or {})
        self._hooks = hooks
        self.worker: WorkerBase | None = None
        self._thread_device: ThreadDevice | None = None
        self._observers: HotHook | None = None

    def __getstate__(self) -> dict[str, Any]:
        # The hook relay belongs to the driver's registry: a worker process loads its own.
        state = self.__dict__.copy()
        state["_hooks"] = None
        state["worker"] = None
        state["_thread_device"] = None
        state["_observers"] = None
        return state

    def portable(self) -> WorkerWrapper:
        """A copy to hand to another process (forked ones included): without this process's
        hook relay, so that the worker's process loads its own plugins."""
        clone = copy.copy(self)  # goes through __getstate__
        return clone

    @property
    def hooks(self) -> pluggy.HookRelay:
        """The worker-side hook relay (a registry is loaded in this process if none was given)."""
        if self._hooks is None:
            from ._registry import Registry  # deferred: only needed in a fresh worker process

            self._hooks = Registry.from_entry_points().hook
        return self._hooks

    def init_worker(self) -> None:
        """Apply env, call the start hook, build the worker, init its device, load the model."""
        os.environ.update(self.env)
        self.hooks.executor_worker_process_started(context=self.context)
        cls = self.worker_cls
        if isinstance(cls, str):
            cls = resolve_qualname(cls)
        if not (isinstance(cls, type) and issubclass(cls, WorkerBase)):
            raise TypeError(f"worker_cls {self.worker_cls!r} is not a WorkerBase subclass")
        self.worker = cls(context=self.context, **self.worker_kwargs)
        self.worker.init_device()
        self.worker.load_model()
        # The device the worker made current is current on every thread that runs its
        # methods (see _thread_device): backends run calls on threads other than this one.
        self._thread_device = capture_thread_device()
        self.hooks.executor_worker_ready(worker=self.worker, context=self.context)

    def _resolve(self, method: str | bytes | Callable[..., Any]) -> Callable[..., Any]:
        worker = self.worker
        if worker is None:
            raise RuntimeError(f"worker rank {self.context.rank} was not initialised")
        loaded = loads_method(method)
        if isinstance(loaded, str):
            func = getattr(worker, loaded, None)
            if func is None and loaded == REJOIN_METHOD:
                return self._rejoin
            if func is None or not callable(func):
                raise AttributeError(
                    f"{type(worker).__name__} has no method {loaded!r} "
                    f"(collective_rpc takes a worker method name or a callable(worker, ...))"
                )
            bound: Callable[..., Any] = func
            return bound
        fn = loaded

        def call_with_worker(*args: Any, **kwargs: Any) -> Any:
            return fn(worker, *args, **kwargs)

        return call_with_worker

    def _rejoin(self, contexts: Sequence[WorkerContext]) -> None:
        """The rejoin call of a rank replacement: a survivor (its context differs from its new
        one) rejoins its peers in its new context; a new rank is in it already."""
        context = contexts[self.context.rank]
        if context.rank != self.context.rank:
            raise ValueError(f"rank {self.context.rank} was sent the context of {context.rank}")
        if context == self.context:
            return
        worker = self.worker
        assert worker is not None  # _resolve checked
        worker.rejoin(context)
        self.context = context
        # The device the rejoin made current (a new process group binds it) is current on
        # every thread that runs this worker's methods, as after init_worker.
        self._thread_device = capture_thread_device()

    def run_method(
        self,
        method: str | bytes | Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        """Run ``method`` (a name, a callable taking the worker, or a cloudpickled callable)."""
        if self._thread_device is not None:
            self._thread_device.bind()
        # A worker method's name, the common case, resolved here rather than in _resolve
        # (which gives the errors and the other forms): this runs once per call and rank.
        if type(method) is str:
            func = getattr(self.worker, method, None)
            if func is None or not callable(func):
                func = self._resolve(method)
        else:
            func = self._resolve(method)
        observers = self._observers
        if observers is None:
            observers = self._observers = HotHook(self.hooks.executor_worker_rpc_finished)
        observe = observers.current()
        if observe is None:  # nobody observes RPCs: no timing, no hook call
            return func(*args, **kwargs) if kwargs else func(*args)
        start = time.perf_counter()
        error: BaseException | None = None
        try:
            return func(*args, **kwargs) if kwargs else func(*args)
        except BaseException as exc:
            error = exc
            raise
        finally:
            # In the specification's order: context, method, duration_s, error.
            name = method if type(method) is str else method_name(method)
            observe(self.context, name, time.perf_counter() - start, error)

    def execute(
        self,
        method: str | bytes | Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[bool, Any]:
        """Like :meth:`run_method`, but returns ``(True, result)`` or ``(False, RemoteFailure)``.

        For backends that ship results across a process boundary.
        """
        try:
            return True, self.run_method(method, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - every worker error is shipped to the driver
            return False, RemoteFailure.capture(self.context.rank, method_name(method), exc)

    def handle(
        self,
        method: str | bytes | Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        reply_rank: int | None = None,
        *,
        capture: bool = True,
    ) -> tuple[bool, Any] | None:
        """Run one call as the protocol wants it answered: ``(True, result)``, ``(False,
        failure)``, or ``None`` when this rank need not answer (``reply_rank`` names another
        rank and this one succeeded). The failure is a :class:`RemoteFailure` (it pickles
        whatever the exception is), or with ``capture=False`` the exception itself (for a
        worker in the driver's process)."""
        try:
            result = self.run_method(method, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - every worker error is shipped to the driver
            if capture:
                return False, RemoteFailure.capture(self.context.rank, method_name(method), exc)
            return False, exc
        if reply_rank is not None and reply_rank != self.context.rank:
            return None
        return True, result

    def shutdown(self) -> None:
        """Call the stopping hook and the worker's ``shutdown`` (once)."""
        worker, self.worker = self.worker, None
        if self._thread_device is not None:
            self._thread_device.bind()
        self.hooks.executor_worker_stopping(worker=worker, context=self.context)
        if worker is not None:
            worker.shutdown()
