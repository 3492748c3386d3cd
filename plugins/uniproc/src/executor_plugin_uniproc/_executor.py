"""The ``uni`` backend: one worker in the driver's own process."""

from __future__ import annotations

import queue
import socket
import threading
from collections.abc import Callable
from typing import Any, ClassVar

from executor_core import Executor, WorkerError
from executor_core.backend import Call, Transport, WorkerContext

__all__ = ["InProcessTransport", "UniProcExecutor"]


class InProcessTransport(Transport):
    """Runs the one worker this process hosts; calls are method calls.

    A blocking call without a timeout, made while nothing else runs, is a direct method call
    in the caller's thread. Other calls (``non_block``, a timeout, or calls queued behind one)
    run in order on one daemon thread; a timeout is then honoured on the caller's side (the
    method itself cannot be interrupted and runs to its end in that thread). A daemon thread
    (unlike a pool's) cannot keep the interpreter alive when such a call never returns.
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
        self._calls: queue.SimpleQueue[Call | None] = queue.SimpleQueue()
        name = f"executor-{context.backend}-rank{context.rank}"
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
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
        self._calls.put(call)
        return True

    def _serve(self) -> None:
        """The worker thread: run the calls sent, in order, until :meth:`close`."""
        while (call := self._calls.get()) is not None:
            try:
                reply = self._wrapper.handle(
                    call.method, call.args, call.kwargs, call.reply_rank, capture=False
                )
                if reply is not None:
                    self.host.deliver(call.seq, self.rank, *reply)
            except BaseException:  # noqa: BLE001 - a worker's SystemExit ends no thread
                pass

    def close(self, graceful: bool) -> None:
        thread = getattr(self, "_thread", None)
        if thread is not None:  # stop after the calls queued; wait a bounded time for them
            self._calls.put(None)
            if threading.current_thread() is not thread:
                thread.join(5.0)
        wrapper = getattr(self, "_wrapper", None)
        if wrapper is not None:
            wrapper.shutdown()


class UniProcExecutor(Executor):
    """Runs the single worker in this process (backend ``"uni"``); see
    :class:`InProcessTransport`. ``config.env`` is applied to this process's environment
    while the executor lives and restored at shutdown."""

    transport_cls: ClassVar[type[Transport]] = InProcessTransport
