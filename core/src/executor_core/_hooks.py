"""The pluggy hook specifications (each documented in docs/hooks.md; a test checks it), and
:class:`CallObserver`, which calls the driver-side observer hooks of one executor."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import argparse

    from ._config import ExecutorConfig
    from ._errors import WorkerDiedError
    from ._registry import BackendSpec
    from ._worker import WorkerBase, WorkerContext

__all__ = ["PROJECT_NAME", "CallObserver", "DirectHook", "hookimpl", "hookspec"]

#: The one pluggy project name: spec marker, impl marker and plugin manager all use it.
PROJECT_NAME = "executor"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
#: Decorate a plugin module's functions with this to implement a hook.
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

#: Call ids: unique in the process, so that a plugin pairs start and end with the id alone.
_call_ids = itertools.count(1)


class DirectHook:
    """One hook's plain implementations, called directly with positional values in the order
    of its specification: pluggy's general call (argument checks, the wrapper protocol, a
    result list) costs more than a cheap observer. Kept by ``executor bench``'s overhead row
    "observed collective_rpc": 0.6 µs over a direct call with it, 2.0 µs through pluggy
    (3.5 times worse); the worker's ``executor_worker_rpc_finished`` goes the same way (every
    ``uni`` row, whose whole call is a microsecond). Plugins may come and go at any time:
    each :meth:`current` compares the implementations with those it has seen (pluggy's own
    list, changed in place, so the check allocates nothing); with a wrapper among them,
    pluggy's own call is used."""

    __slots__ = ("_caller", "_live", "_names", "_seen", "call")

    def __init__(self, caller: pluggy.HookCaller) -> None:
        self._caller = caller
        live = getattr(caller, "_hookimpls", None)  # pluggy's list, where it is reachable
        self._live: list[Any] | None = live if isinstance(live, list) else None
        self._names = tuple(caller.spec.argnames) if caller.spec is not None else ()
        self._seen: list[Any] = []
        #: A function of the values in the specification's order, or None without a plugin.
        self.call: Any = None

    def __bool__(self) -> bool:
        return bool(self._caller.get_hookimpls())

    def current(self) -> Any:
        """:attr:`call` as of the implementations the hook has now."""
        impls = self._live if self._live is not None else self._caller.get_hookimpls()
        if impls != self._seen:
            self._rebuild(impls)
        return self.call

    def _rebuild(self, impls: list[Any]) -> None:
        # Apart from current(): the closures made here would cost current() their cells.
        self._seen, names = list(impls), self._names
        if not impls:
            self.call = None
        elif any(impl.wrapper or impl.hookwrapper for impl in impls):
            caller = self._caller
            self.call = lambda *values: caller(**dict(zip(names, values, strict=True)))
        else:  # pluggy's order: the last registered first
            where = {name: index for index, name in enumerate(names)}
            plan = [(i.function, [where[n] for n in i.argnames]) for i in reversed(impls)]
            if len(plan) == 1 and plan[0][1] == list(range(len(names))):
                self.call = plan[0][0]
            else:
                self.call = lambda *values: [f(*[values[k] for k in ks]) for f, ks in plan]


class CallObserver:
    """The observer hooks of one executor's calls and sleep state. With no implementation a
    call pays one look at each hook's implementations; an implementation that raises is
    logged, and the call goes on."""

    def __init__(self, hooks: pluggy.HookRelay, backend: str, world_size: int) -> None:
        self._hooks, self._backend, self._world_size = hooks, backend, world_size
        self._started = DirectHook(hooks.executor_call_started)
        self._finished = DirectHook(hooks.executor_call_finished)

    @property
    def impls(self) -> tuple[Any, ...]:
        """Each hook's implementations, live (pluggy's own lists where reachable): the call
        path tests their truth, which costs no call (every ``uni`` row: 10% of a call)."""
        return tuple(h if h._live is None else h._live for h in (self._started, self._finished))

    def started(self, method: str, non_block: bool) -> int:
        """Call the started hook; return the call's id."""
        call_id = next(_call_ids)
        started = self._started.current()
        if started is not None:
            try:
                started(self._backend, method, call_id, self._world_size, non_block)
            except Exception:  # noqa: BLE001 - an observer never breaks a call; logged
                _log_hook_error("executor_call_started")
        return call_id

    def finished(
        self, method: str, call_id: int, start: float, error: BaseException | None
    ) -> None:
        """Call the finished hook of a call started at ``start`` (``time.perf_counter``)."""
        finished = self._finished.current()
        if finished is not None:
            duration = time.perf_counter() - start
            try:
                finished(self._backend, method, call_id, duration, error)
            except Exception:  # noqa: BLE001 - an observer never breaks a call; logged
                _log_hook_error("executor_call_finished")

    def sleep_changed(self, tags: frozenset[str]) -> None:
        """Call ``executor_sleep_changed`` (what is asleep now)."""
        self._call("executor_sleep_changed", sleeping=bool(tags), tags=tags)

    def _call(self, hook: str, **kwargs: Any) -> None:
        try:
            getattr(self._hooks, hook)(backend=self._backend, **kwargs)
        except Exception:  # noqa: BLE001 - an observer never breaks a call; logged
            _log_hook_error(hook)


def _log_hook_error(hook: str) -> None:
    import logging  # deferred: only needed on this error path

    logging.getLogger("executor_core").exception("an implementation of %s raised", hook)


# --- the specifications (docs/hooks.md says each in full) ---------------------------------


@hookspec
def executor_register_backends() -> Sequence[BackendSpec]:
    """Declare the backends this plugin provides (:class:`~executor_core.BackendSpec` objects,
    each naming its executor class by qualname, imported only when chosen)."""
    raise NotImplementedError  # pragma: no cover - specs are never called


@hookspec(firstresult=True)
def executor_select_backend(config: ExecutorConfig, available: Sequence[str]) -> str | None:
    """Choose the backend for ``backend="auto"`` among ``available``, or return ``None`` to
    let others decide (the core's built-in rule runs last)."""
    raise NotImplementedError  # pragma: no cover


@hookspec
def executor_register_commands(commands: argparse._SubParsersAction[Any]) -> None:
    """Add subcommands to the ``executor`` command line (``commands.add_parser``, with
    ``set_defaults(func=handler)``); import heavy code in the handler, not here."""
    raise NotImplementedError  # pragma: no cover


@hookspec
def executor_call_started(
    backend: str, method: str, call_id: int, world_size: int, non_block: bool
) -> None:
    """A valid call is about to reach the workers (:func:`executor_call_finished` follows
    once, with the same ``call_id``). On the hot path: keep it cheap."""


@hookspec
def executor_call_finished(
    backend: str, method: str, call_id: int, duration_s: float, error: BaseException | None
) -> None:
    """The call ``call_id`` completed (``error`` is what the caller gets, or ``None``); in the
    caller's thread, or for ``non_block`` in the thread that completes it."""


@hookspec
def executor_worker_died(
    backend: str, ranks: tuple[int, ...], node: str | None, error: WorkerDiedError
) -> None:
    """Workers died (one rank, or the ranks of a lost ``node``): once per death, before the
    calls in flight raise it."""


@hookspec
def executor_recovery_started(backend: str, ranks: tuple[int, ...], error: WorkerDiedError) -> None:
    """The executor starts to recover from the death of ``ranks`` (from the recovery thread)."""


@hookspec
def executor_recovered(backend: str, ranks: tuple[int, ...], duration_s: float) -> None:
    """The executor is back after the death of ``ranks``, ``duration_s`` seconds later."""


@hookspec
def executor_sleep_changed(backend: str, sleeping: bool, tags: frozenset[str]) -> None:
    """``sleep`` or ``wake_up`` changed what is asleep: ``tags`` is what is asleep now."""


@hookspec
def executor_worker_process_started(context: WorkerContext) -> None:
    """In a worker's process, before the worker is built and ``init_device`` runs (a device
    plugin sets up its device here)."""


@hookspec
def executor_worker_ready(worker: WorkerBase, context: WorkerContext) -> None:
    """In a worker's process: ``init_device`` and ``load_model`` have run."""


@hookspec
def executor_worker_rpc_finished(
    context: WorkerContext, method: str, duration_s: float, error: BaseException | None
) -> None:
    """In a worker's process: a call finished (``error`` is ``None`` when it returned). On
    the worker's hot path: keep it cheap."""


@hookspec
def executor_worker_stopping(worker: WorkerBase | None, context: WorkerContext) -> None:
    """In a worker's process: the worker shuts down (``None`` if it was never built)."""
