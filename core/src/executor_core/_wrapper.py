"""WorkerWrapper: hosts the user's worker in the process that runs it, and runs its calls.

Also what a call's method needs to cross a process boundary (names pass as they are,
callables are cloudpickled), and the worker's accelerator device made current on every thread
that runs its methods: CUDA (and torch's other accelerators) keep the current device per
thread, and backends run calls on threads other than the one that built the worker.
"""

from __future__ import annotations

import copy
import functools
import importlib
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._errors import RemoteFailure
from ._hooks import DirectHook
from ._registry import Registry, resolve_qualname
from ._worker import WorkerBase, WorkerContext

if TYPE_CHECKING:
    import pluggy

__all__ = ["REJOIN_METHOD", "WorkerWrapper", "dumps_method", "method_name", "preload_worker"]

#: The call a rank replacement sends every rank, with every rank's new context: a survivor
#: runs ``WorkerBase.rejoin`` with its own; a new rank (already in that context) only answers.
REJOIN_METHOD = "__executor_rejoin__"


def method_name(method: str | Callable[..., Any] | bytes) -> str:
    """A readable name for a worker method: its name, or a callable's qualified name."""
    if isinstance(method, str):
        return method
    if isinstance(method, bytes):
        return "<pickled callable>"
    return getattr(method, "__qualname__", None) or repr(method)


def dumps_method(method: str | Callable[..., Any]) -> str | bytes:
    """A method ready for another process: a name as it is, a callable cloudpickled (which
    serialises lambdas and closures by value, as plain pickle cannot)."""
    if isinstance(method, str):
        return method
    if not callable(method):
        raise TypeError(
            f"method must be a worker method name or a callable taking the worker, "
            f"not {type(method).__name__}"
        )
    import cloudpickle  # deferred: only needed when a callable crosses a process boundary

    data: bytes = cloudpickle.dumps(method)
    return data


def preload_worker(worker_cls: type | str) -> None:
    """Import the module that defines ``worker_cls`` (a class, or its ``"module:Class"``
    name): what a warm spare, a process that waits to be handed a rank, does ahead, so that
    the hand-over pays no import. Raises what the import raises."""
    if isinstance(worker_cls, str):
        resolve_qualname(worker_cls)
    else:
        importlib.import_module(worker_cls.__module__)


def _device_setter() -> Callable[[], Any] | None:
    """A call that makes this thread's current accelerator device current on another thread,
    or None when this process has not initialised one (torch is never imported here)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if torch.cuda.is_initialized():
        return functools.partial(torch.cuda.set_device, torch.cuda.current_device())
    # Other accelerators (XPU, out-of-tree NPUs) through torch.accelerator, where it exists;
    # asking for the type does not initialise the device.
    accelerator = getattr(torch, "accelerator", None)
    device = accelerator.current_accelerator() if accelerator is not None else None
    if device is None or device.type == "cuda":
        return None
    module = torch.get_device_module(device.type)
    is_initialized = getattr(module, "is_initialized", None)
    if is_initialized is None or not is_initialized():
        return None
    return functools.partial(module.set_device, module.current_device())


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
        #: Makes the worker's device current on a thread (None: no accelerator), and the
        #: threads on which it did.
        self._set_device: Callable[[], Any] | None = None
        self._bound = threading.local()
        #: The observers of ``executor_worker_rpc_finished``, called directly.
        self._observers: DirectHook | None = None

    def __getstate__(self) -> dict[str, Any]:
        # The hook relay belongs to the driver's registry: a worker process loads its own.
        state = self.__dict__.copy()
        state.update(_hooks=None, worker=None, _set_device=None, _bound=None, _observers=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _bound=threading.local())

    def portable(self) -> WorkerWrapper:
        """A copy to hand to another process (forked ones included): without this process's
        hook relay, so that the worker's process loads its own plugins."""
        return copy.copy(self)  # goes through __getstate__

    @property
    def hooks(self) -> pluggy.HookRelay:
        """The worker-side hook relay (a registry is loaded in this process if none was given)."""
        if self._hooks is None:
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
        self._capture_device()
        self.hooks.executor_worker_ready(worker=self.worker, context=self.context)

    def _capture_device(self) -> None:
        """The device current now is made current on every other thread before its first call."""
        self._set_device = _device_setter()
        self._bound = threading.local()
        self._bound.done = True

    def _resolve(self, method: str | bytes | Callable[..., Any]) -> Callable[..., Any]:
        worker = self.worker
        if worker is None:
            raise RuntimeError(f"worker rank {self.context.rank} was not initialised")
        loaded: str | Callable[..., Any] = (
            pickle.loads(method) if isinstance(method, bytes) else method
        )
        if not isinstance(loaded, str):
            fn = loaded
            return lambda *args, **kwargs: fn(worker, *args, **kwargs)
        method = loaded
        func = getattr(worker, method, None)
        if func is None and method == REJOIN_METHOD:
            return self._rejoin
        if func is None or not callable(func):
            raise AttributeError(
                f"{type(worker).__name__} has no method {method!r} "
                f"(collective_rpc takes a worker method name or a callable(worker, ...))"
            )
        bound: Callable[..., Any] = func
        return bound

    def _rejoin(self, contexts: Sequence[WorkerContext]) -> None:
        """The rejoin call of a rank replacement: a survivor (its context differs from its new
        one) rejoins its peers in its new context; a new rank is in it already."""
        context = contexts[self.context.rank]
        if context.rank != self.context.rank:
            raise ValueError(f"rank {self.context.rank} was sent the context of {context.rank}")
        if context == self.context:
            return
        assert self.worker is not None  # _resolve checked
        self.worker.rejoin(context)
        self.context = context
        self._capture_device()  # a new process group may have made another device current

    def run_method(
        self,
        method: str | bytes | Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        """Run ``method`` (a name, a callable taking the worker, or a cloudpickled callable)."""
        if self._set_device is not None and not getattr(self._bound, "done", False):
            self._set_device()
            self._bound.done = True
        # The common case, a worker method's name, is looked up here (_resolve gives the
        # errors and the other forms).
        func = getattr(self.worker, method, None) if type(method) is str else None
        if func is None or not callable(func):
            func = self._resolve(method)
        observers = self._observers
        if observers is None:
            observers = self._observers = DirectHook(self.hooks.executor_worker_rpc_finished)
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
        finally:  # in the specification's order: context, method, duration_s, error
            observe(self.context, method_name(method), time.perf_counter() - start, error)

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
        if self._set_device is not None:
            self._set_device()
        self.hooks.executor_worker_stopping(worker=worker, context=self.context)
        if worker is not None:
            worker.shutdown()
