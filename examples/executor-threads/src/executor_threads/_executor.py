"""ThreadExecutor: each rank's worker runs on a thread of its own, fed by a queue."""

from __future__ import annotations

import queue
import threading

from executor_core import Executor, WorkerError
from executor_core.backend import Call, Transport, WorkerWrapper

_STOP = None  # what a rank's queue gets when its thread should stop
Queue = queue.SimpleQueue[Call | None]


def _serve(transport: ThreadTransport, wrapper: WorkerWrapper, calls: Queue) -> None:
    rank = wrapper.context.rank
    try:
        wrapper.init_worker()
    except Exception as exc:  # noqa: BLE001 - handed to start(), which raises it
        transport.started.put((rank, exc))
        wrapper.shutdown()
        return
    transport.started.put((rank, None))
    while (call := calls.get()) is not _STOP:
        reply = wrapper.handle(call.method, call.args, call.kwargs, call.reply_rank, capture=False)
        if reply is not None:
            transport.host.deliver(call.seq, rank, *reply)
    wrapper.shutdown()


class ThreadTransport(Transport):
    """Starts a thread per rank; a call is put on every rank's queue; replies are delivered
    by the rank's thread itself (``polls`` stays False)."""

    def start(self) -> None:
        self.started: queue.SimpleQueue[tuple[int, Exception | None]] = queue.SimpleQueue()
        self.queues: list[Queue] = [Queue() for _ in range(self.host.config.world_size)]
        self.threads = [
            threading.Thread(
                target=_serve,
                args=(self, self.host.wrapper(context), self.queues[context.rank]),
                name=f"executor-threads-rank{context.rank}",
                daemon=True,
            )
            for context in self.host.contexts()
        ]
        for thread in self.threads:
            thread.start()
        errors = dict(self.started.get(timeout=60) for _ in self.threads)
        for rank, error in sorted(errors.items()):
            if error is not None:
                raise WorkerError.from_exception(rank, "init_worker", error) from error

    def send(self, call: Call) -> bool:
        for calls in self.queues:
            calls.put(call)
        return True

    def close(self, graceful: bool) -> None:
        for calls in getattr(self, "queues", []):
            calls.put(_STOP)
        for thread in getattr(self, "threads", []):
            thread.join(5.0 if graceful else 1.0)


class ThreadExecutor(Executor):
    """The ``threads`` backend: every rule of a call comes from the core."""

    transport_cls = ThreadTransport
