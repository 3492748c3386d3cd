"""UniProcExecutor: one worker in the driver's process."""

from __future__ import annotations

import concurrent.futures
import os
import socket
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

from executor_core import (
    Executor,
    ExecutorError,
    RPCTimeoutError,
    WorkerContext,
    WorkerError,
    WorkerWrapper,
    method_name,
    tcp_init_method,
)

from ._serial import SerialRunner

__all__ = ["UniProcExecutor"]


def _restore_env(saved: Mapping[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


class UniProcExecutor(Executor):
    """Runs the single worker in this process.

    A blocking call with no timeout is a direct method call. ``non_block=True`` and calls with
    a timeout go through one daemon thread, so futures complete in submission order. A timeout
    is honoured on the caller's side only: the caller gets :class:`RPCTimeoutError` on time,
    but the worker method itself cannot be interrupted and runs to its end in that thread
    (later calls queue behind it). ``config.env`` is applied to this process's environment
    while the executor lives and restored at shutdown.
    """

    def _worker_context(self) -> WorkerContext:
        """The single worker's place in the job (the external launcher overrides this)."""
        config = self.config
        if config.world_size != 1:
            raise ExecutorError(
                f"the 'uni' backend runs exactly one worker in this process, but world_size="
                f"{config.world_size}; use backend='mp' (one machine) or 'ray' (a cluster)"
            )
        return WorkerContext(
            rank=0,
            local_rank=0,
            world_size=1,
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            distributed_init_method=tcp_init_method(config.distributed_host),
            device=config.device,
            local_world_size=1,
            node_id=socket.gethostname(),
            backend="uni",
        )

    def _init_executor(self) -> None:
        config = self.config
        context = self._worker_context()
        self.add_cleanup(_env_restorer({key: os.environ.get(key) for key in config.env}))
        self._wrapper = WorkerWrapper(
            config.worker_cls,
            config.worker_kwargs,
            context,
            env=config.env,
            hooks=self.registry.hook,
        )
        self._runner = SerialRunner(f"executor-{context.backend}-rank{context.rank}")
        self.add_cleanup(self._runner.close)
        try:
            self._wrapper.init_worker()
        except Exception as exc:
            raise WorkerError.from_exception(context.rank, "init_worker", exc) from exc

    @property
    def rank(self) -> int:
        """The rank of the worker this process hosts."""
        return self._wrapper.context.rank

    def _call(
        self, method: str | Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any] | None
    ) -> list[Any]:
        try:
            return [self._wrapper.run_method(method, args, kwargs)]
        except Exception as exc:
            raise WorkerError.from_exception(self.rank, method_name(method), exc) from exc

    def collective_rpc(  # type: ignore[override]  # one implementation for both overloads
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> list[Any] | Future[list[Any]]:
        self.check_open()
        if unique_reply_rank is not None:
            self.check_reply_rank(unique_reply_rank)
        if timeout is not None or self.config.rpc_timeout is not None:
            timeout = self.resolve_timeout(timeout)
        if not non_block and timeout is None and self._runner.pending == 0:
            return self._call(method, args, kwargs)
        future = self._runner.submit(lambda: self._call(method, args, kwargs))
        if non_block:
            return future
        try:
            result: list[Any] = future.result(timeout)
            return result
        except concurrent.futures.TimeoutError:
            raise RPCTimeoutError(method_name(method), [self.rank], timeout or 0.0) from None

    def _shutdown_workers(self) -> None:
        wrapper = getattr(self, "_wrapper", None)
        runner = getattr(self, "_runner", None)
        if runner is not None:
            runner.close()
        if wrapper is not None:
            wrapper.shutdown()


def _env_restorer(saved: Mapping[str, str | None]) -> Callable[[], None]:
    return lambda: _restore_env(saved)
