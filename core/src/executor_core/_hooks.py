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

__all__ = ["PROJECT_NAME", "CallObserver", "hookimpl", "hookspec"]

#: The one pluggy project name: spec marker, impl marker and plugin manager all use it.
PROJECT_NAME = "executor"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
#: Decorate a plugin module's functions with this to implement a hook.
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

#: Call ids: unique in the process, so that a plugin pairs start and end with the id alone.
_call_ids = itertools.count(1)


class CallObserver:
    """The observer hooks of one executor's calls and sleep state. With no implementation a
    call pays one look at the hooks' implementations; an implementation that raises is
    logged, and the call goes on."""

    def __init__(self, hooks: pluggy.HookRelay, backend: str, world_size: int) -> None:
        self._hooks, self._backend, self._world_size = hooks, backend, world_size

    def active(self) -> bool:
        """Whether a plugin observes calls now."""
        hooks = self._hooks
        return bool(
            hooks.executor_call_started.get_hookimpls()
            or hooks.executor_call_finished.get_hookimpls()
        )

    def started(self, method: str, non_block: bool) -> int:
        """Call the started hook; return the call's id."""
        call_id = next(_call_ids)
        self._call(
            "executor_call_started",
            method=method,
            call_id=call_id,
            world_size=self._world_size,
            non_block=non_block,
        )
        return call_id

    def finished(
        self, method: str, call_id: int, start: float, error: BaseException | None
    ) -> None:
        """Call the finished hook of a call started at ``start`` (``time.perf_counter``)."""
        duration = time.perf_counter() - start
        self._call(
            "executor_call_finished",
            method=method,
            call_id=call_id,
            duration_s=duration,
            error=error,
        )

    def sleep_changed(self, tags: frozenset[str]) -> None:
        """Call ``executor_sleep_changed`` (what is asleep now)."""
        self._call("executor_sleep_changed", sleeping=bool(tags), tags=tags)

    def _call(self, hook: str, **kwargs: Any) -> None:
        try:
            getattr(self._hooks, hook)(backend=self._backend, **kwargs)
        except Exception:
            import logging

            logging.getLogger("executor_core").exception("an implementation of %s raised", hook)


# --- driver side -------------------------------------------------------------------------


@hookspec
def executor_register_backends() -> Sequence[BackendSpec]:
    """Declare the backends this plugin provides.

    Return a sequence of :class:`~executor_core.BackendSpec`. The executor class is named by
    a ``"package.module:Class"`` string so that nothing heavy is imported until the backend
    is chosen. Called once per registry, in the driver and in worker processes alike.
    """
    raise NotImplementedError  # pragma: no cover - specs are never called


@hookspec(firstresult=True)
def executor_select_backend(config: ExecutorConfig, available: Sequence[str]) -> str | None:
    """Choose the backend name for ``backend="auto"``; return ``None`` to let others decide.

    ``available`` lists the names of the backends that are installed and loaded. The first
    non-``None`` answer wins; the core's built-in rule runs last.
    """
    raise NotImplementedError  # pragma: no cover


@hookspec
def executor_register_commands(commands: argparse._SubParsersAction[Any]) -> None:
    """Add subcommands to the ``executor`` command line.

    ``commands`` is the ``argparse`` subparsers object of ``executor``: call
    ``commands.add_parser(name, help=...)``, add its arguments, and
    ``set_defaults(func=handler)``, where ``handler(args: argparse.Namespace) -> int``
    returns the exit status. Import heavy code inside the handler, not here: this hook runs
    every time ``executor`` starts. A name already taken raises an error naming it.
    """
    raise NotImplementedError  # pragma: no cover


# --- driver side: observers of calls and of the executor's state --------------------------


@hookspec
def executor_call_started(
    backend: str, method: str, call_id: int, world_size: int, non_block: bool
) -> None:
    """A call was accepted (its arguments are valid) and is about to reach the workers.

    ``call_id`` is unique in this process and is passed again to
    :func:`executor_call_finished`, which follows exactly once. Runs in the thread that sends
    the call, on the hot path: keep it cheap, and never call the executor from it.
    """


@hookspec
def executor_call_finished(
    backend: str, method: str, call_id: int, duration_s: float, error: BaseException | None
) -> None:
    """The call ``call_id`` completed: ``error`` is ``None`` when it succeeded, otherwise what
    the caller gets (``WorkerError``, ``RPCTimeoutError``, ``ExecutorFailedError``, ...).

    Runs in the caller's thread for a blocking call; for ``non_block`` calls in the thread that
    completes the call, before the future is. Keep it cheap; never call the executor from it.
    """


@hookspec
def executor_worker_died(
    backend: str, ranks: tuple[int, ...], node: str | None, error: WorkerDiedError
) -> None:
    """Workers died: ``ranks`` are gone (one rank, or all the ranks of a lost ``node``).
    Called once per death, from the thread that noticed; the executor has failed, or, with a
    recovery policy, :func:`executor_recovery_started` follows."""


@hookspec
def executor_recovery_started(backend: str, ranks: tuple[int, ...], error: WorkerDiedError) -> None:
    """The executor starts to recover from the death of ``ranks`` (``error``): its calls in
    flight have failed, and its workers are being started again. Called from the recovery
    thread; :func:`executor_recovered` follows if it succeeds (else the executor fails, and
    its failure callbacks run)."""


@hookspec
def executor_recovered(backend: str, ranks: tuple[int, ...], duration_s: float) -> None:
    """The executor is back after the death of ``ranks``: ``duration_s`` seconds from the
    start of the recovery to workers ready for calls. Called from the thread that
    recovered (the recovery thread, or the caller of ``Executor.recover``)."""


@hookspec
def executor_sleep_changed(backend: str, sleeping: bool, tags: frozenset[str]) -> None:
    """:meth:`Executor.sleep` or :meth:`Executor.wake_up` changed what is asleep: ``tags``
    is what is asleep now (``sleeping`` is ``bool(tags)``)."""


# --- worker side: called inside each worker process -----------------------------------------


@hookspec
def executor_worker_process_started(context: WorkerContext) -> None:
    """A worker process (or actor) is about to build its worker.

    Runs before the user's worker is constructed and before ``init_device``: a device plugin
    sets up its device or environment here (``context.device`` names the device type).
    """


@hookspec
def executor_worker_ready(worker: WorkerBase, context: WorkerContext) -> None:
    """The worker has run ``init_device`` and ``load_model`` and is ready for calls."""


@hookspec
def executor_worker_rpc_finished(
    context: WorkerContext, method: str, duration_s: float, error: BaseException | None
) -> None:
    """A call on the worker finished (``error`` is ``None`` when it returned normally).

    Observer plugins (tracing, metrics) see every RPC here without touching the backend.
    Keep it cheap: it runs on the worker's hot path.
    """


@hookspec
def executor_worker_stopping(worker: WorkerBase | None, context: WorkerContext) -> None:
    """The worker is shutting down (``worker`` is ``None`` if it was never built)."""
