"""Records every worker-side hook call as a JSON line, in whichever process it runs.

Active only when EXECUTOR_FIXTURE_OBSERVER_LOG names a file (tests set it through
ExecutorConfig.env, so it reaches worker processes and actors on every backend).
"""

from __future__ import annotations

import json
import os
from typing import Any

from executor_core import WorkerBase, WorkerContext, hookimpl

LOG_ENV_VAR = "EXECUTOR_FIXTURE_OBSERVER_LOG"


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
