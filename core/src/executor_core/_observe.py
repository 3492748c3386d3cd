"""Driver-side observer hooks: a call's start and end, a worker's death, the sleep state.

The per-call hooks (``executor_call_started``, ``executor_call_finished``) are on the hot
path. With no implementation the executor pays one truth test of two lists per call
(:attr:`CallObserver.impls`): pluggy's own lists of implementations, which it changes in
place when plugins come and go. With implementations, :class:`~executor_core._hothook.HotHook`
calls them directly. An implementation that raises is logged and the call goes on: an
observer never breaks a call, nor the thread that completes it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._errors import WorkerDiedError
from ._hothook import HotHook, live_impls

if TYPE_CHECKING:
    import pluggy

    from ._errors import ExecutorFailedError

__all__ = ["CallObserver", "Observation", "death_reporter", "notify_sleep"]

#: Call ids: unique in the process, so that a plugin pairs start and end with the id alone.
_call_ids = itertools.count(1)


def _log_hook_error(hook: str) -> None:
    import logging  # deferred: only needed on this error path

    logging.getLogger("executor_core").exception("an implementation of %s raised", hook)


class CallObserver:
    """The per-call hooks of one executor."""

    __slots__ = ("_finished", "_started", "backend", "impls", "world_size")

    def __init__(self, hooks: pluggy.HookRelay, backend: str, world_size: int) -> None:
        self.backend = backend
        self.world_size = world_size
        started = hooks.executor_call_started
        finished = hooks.executor_call_finished
        self._started = HotHook(started)
        self._finished = HotHook(finished)
        #: True (either list non-empty) while any plugin observes calls.
        self.impls: tuple[Any, Any] = (live_impls(started), live_impls(finished))

    def begin(self, method: str, non_block: bool) -> int:
        """Call the started hook; return the call's id."""
        call_id = next(_call_ids)
        started = self._started.current()
        if started is not None:
            try:
                # In the specification's order: backend, method, call_id, world_size, non_block.
                started(self.backend, method, call_id, self.world_size, non_block)
            except Exception:  # noqa: BLE001 - an observer never breaks a call; logged
                _log_hook_error("executor_call_started")
        return call_id

    def finished(
        self, method: str, call_id: int, duration_s: float, error: BaseException | None
    ) -> None:
        """Call the finished hook."""
        finished = self._finished.current()
        if finished is not None:
            try:
                finished(self.backend, method, call_id, duration_s, error)
            except Exception:  # noqa: BLE001 - an observer never breaks a call; logged
                _log_hook_error("executor_call_finished")


class Observation:
    """One observed ``non_block`` call: reports its end once, whichever thread sees it first
    (the one completing it, or the caller when the send raised)."""

    __slots__ = ("_open", "call_id", "method", "observer", "start")

    def __init__(self, observer: CallObserver, method: str, call_id: int, start: float) -> None:
        self.observer = observer
        self.method = method
        self.call_id = call_id
        self.start = start
        self._open = [True]  # popped once: list.pop is atomic

    def end(self, error: BaseException | None) -> None:
        """Call the finished hook (the first time only)."""
        try:
            self._open.pop()
        except IndexError:
            return
        duration = time.perf_counter() - self.start
        self.observer.finished(self.method, self.call_id, duration, error)


def death_reporter(hooks: pluggy.HookRelay, backend: str) -> Callable[[ExecutorFailedError], None]:
    """A failure callback that calls ``executor_worker_died`` when workers died. It holds the
    hook relay and the name only, never the executor."""

    def report(error: ExecutorFailedError) -> None:
        if not isinstance(error, WorkerDiedError):
            return
        try:
            hooks.executor_worker_died(
                backend=backend, ranks=tuple(error.ranks), node=error.node, error=error
            )
        except Exception:  # noqa: BLE001 - an observer never breaks the failure path; logged
            _log_hook_error("executor_worker_died")

    return report


def notify_sleep(hooks: pluggy.HookRelay, backend: str, tags: frozenset[str]) -> None:
    """Call ``executor_sleep_changed`` (what is asleep now)."""
    try:
        hooks.executor_sleep_changed(backend=backend, sleeping=bool(tags), tags=tags)
    except Exception:  # noqa: BLE001 - an observer never breaks sleep or wake-up; logged
        _log_hook_error("executor_sleep_changed")
