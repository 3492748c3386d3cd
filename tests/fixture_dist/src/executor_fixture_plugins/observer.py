"""Records every worker-side hook call as a JSON line, in whichever process it runs, and
every driver-side observer hook call in :data:`driver_events`.

The worker side is active only when EXECUTOR_FIXTURE_OBSERVER_LOG names a file (tests set it
through ExecutorConfig.env, so it reaches worker processes and actors on every backend). The
driver side is active only while a test sets :data:`driver_events` to a list.
"""

from __future__ import annotations

import json
import os
from typing import Any

from executor_core import WorkerBase, WorkerContext, WorkerDiedError, hookimpl

LOG_ENV_VAR = "EXECUTOR_FIXTURE_OBSERVER_LOG"

#: Set to a list to record the driver-side hooks there as ``(hook, {argument: value})``.
driver_events: list[tuple[str, dict[str, Any]]] | None = None


def _record(event: str, context: WorkerContext, **fields: Any) -> None:
    path = os.environ.get(LOG_ENV_VAR)
    if not path:
        return
    line = json.dumps({"event": event, "rank": context.rank, "pid": os.getpid(), **fields})
    with open(path, "a", encoding="utf-8") as log:
        log.write(line + "\n")


@hookimpl
def executor_worker_process_started(context: WorkerContext) -> None:
    _record("process_started", context, backend=context.backend)


@hookimpl
def executor_worker_ready(worker: WorkerBase, context: WorkerContext) -> None:
    _record("ready", context, worker=type(worker).__name__)


@hookimpl
def executor_worker_rpc_finished(
    context: WorkerContext, method: str, duration_s: float, error: BaseException | None
) -> None:
    _record(
        "rpc",
        context,
        method=method,
        duration_s=duration_s,
        error=None if error is None else type(error).__name__,
    )


@hookimpl
def executor_worker_stopping(worker: WorkerBase | None, context: WorkerContext) -> None:
    _record("stopping", context, had_worker=worker is not None)


# --- driver side ---------------------------------------------------------------------------


def _record_driver(hook: str, **arguments: Any) -> None:
    events = driver_events
    if events is not None:
        events.append((hook, arguments))


@hookimpl
def executor_call_started(
    backend: str, method: str, call_id: int, world_size: int, non_block: bool
) -> None:
    _record_driver(
        "call_started",
        backend=backend,
        method=method,
        call_id=call_id,
        world_size=world_size,
        non_block=non_block,
    )


@hookimpl
def executor_call_finished(
    backend: str, method: str, call_id: int, duration_s: float, error: BaseException | None
) -> None:
    _record_driver(
        "call_finished",
        backend=backend,
        method=method,
        call_id=call_id,
        duration_s=duration_s,
        error=error,
    )


@hookimpl
def executor_worker_died(
    backend: str, ranks: tuple[int, ...], node: str | None, error: WorkerDiedError
) -> None:
    _record_driver("worker_died", backend=backend, ranks=ranks, node=node, error=error)


@hookimpl
def executor_sleep_changed(backend: str, sleeping: bool, tags: frozenset[str]) -> None:
    _record_driver("sleep_changed", backend=backend, sleeping=sleeping, tags=tags)
