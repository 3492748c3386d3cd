"""The ``uni`` backend: one worker in the driver's own process."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any, ClassVar

from executor_core import Executor, WorkerError
from executor_core.backend import Call, Transport, WorkerContext

from ._serial import SerialRunner

__all__ = ["InProcessTransport", "UniProcExecutor"]


class InProcessTransport(Transport):
    """Runs the one worker this process hosts; calls are method calls.

    A blocking call without a timeout, made while nothing else runs, is a direct method call
    in the caller's thread. Other calls (``non_block``, a timeout, or calls queued behind one)
    run in order on one daemon thread; a timeout is then honoured on the caller's side (the
    method itself cannot be interrupted and runs to its end in that thread).
    """

    def _context(self) -> WorkerContext:
        """This process's worker's place in the job (the external launcher's is its own)."""
        host = self.host
        return host.context(
            0,
            local_rank=0,
            local_world_size=1,
            node_id=socket.gethostname(),
            init_method=host.rendezvous(),
        )

    def start(self) -> None:
        context = self._context()
        self.rank = context.rank
        self._wrapper = wrapper = self.host.wrapper(context)
        self._runner = SerialRunner(f"executor-{context.backend}-rank{context.rank}")
        try:
            wrapper.init_worker()
        except Exception as exc:
            raise WorkerError.from_exception(context.rank, "init_worker", exc) from exc

    @property
    def ranks(self) -> tuple[int, ...]:
        return (self.rank,)

    def inline_runner(self) -> Callable[..., Any]:
        return self._wrapper.run_method

    def send(self, call: Call) -> bool:
        self._runner.submit(lambda: self._run(call))
        return True

    def _run(self, call: Call) -> None:
        reply = self._wrapper.handle(
            call.method, call.args, call.kwargs, call.reply_rank, capture=False
        )
        if reply is not None:
            self.host.deliver(call.seq, self.rank, *reply)

    def close(self, graceful: bool) -> None:
        runner = getattr(self, "_runner", None)
        if runner is not None:
            runner.close()
        wrapper = getattr(self, "_wrapper", None)
        if wrapper is not None:
            wrapper.shutdown()


class UniProcExecutor(Executor):
    """Runs the single worker in this process (backend ``"uni"``); see
    :class:`InProcessTransport`. ``config.env`` is applied to this process's environment
    while the executor lives and restored at shutdown."""

    transport_cls: ClassVar[type[Transport]] = InProcessTransport
