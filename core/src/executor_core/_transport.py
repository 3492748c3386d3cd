"""The backend contract: what a backend's :class:`Transport` implements.

A transport is a launcher and a carrier of calls; every rule of a call is the core's. It gets
a :class:`~executor_core._host.TransportHost` (the core's side), never the executor: so an
executor dropped without ``shutdown()`` is collected whatever the transport's threads hold,
and its finalizer stops the transport.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from ._calls import Call
    from ._host import TransportHost
    from ._worker import WorkerContext

__all__ = ["Transport", "can_replace"]


class Transport(abc.ABC):
    """What a backend supplies: how workers start and stop, how a call reaches every rank, and
    how replies and deaths come back. Everything else (validation, ordering, timeouts, reply
    gathering, failure, shutdown, cleanup) is the core's.

    Implement :meth:`start`, :meth:`send` and :meth:`close`. Replies reach the core in one of
    two ways: the transport calls :attr:`TransportHost.deliver` from threads of its own
    (``polls = False``, the default), or the core calls :meth:`poll` from the threads that
    wait for replies (``polls = True``: no extra thread hop per call; the core lets one
    thread poll at a time). A transport never holds the executor; :attr:`host` is all it
    needs.
    """

    #: True if replies are read by the core calling :meth:`poll`; False if the transport
    #: delivers them itself.
    polls: ClassVar[bool] = False

    def __init__(self, host: TransportHost) -> None:
        #: The core's side: config, worker contexts and wrappers, deliver, worker_died.
        self.host = host

    @abc.abstractmethod
    def start(self) -> None:
        """Start every worker and return once each has run ``init_device`` and ``load_model``.

        Raise on failure (a worker's error as :class:`~executor_core.WorkerError` naming its
        rank); the core then calls :meth:`close` and the cleanups.
        """

    @abc.abstractmethod
    def send(self, call: Call) -> bool:
        """Deliver ``call`` to every rank. The core calls it from one thread at a time, in
        sequence order; every rank must run calls in the order they were sent.

        May block (a full queue) until ``call.deadline``; return False if that passed before
        the call could be sent. After :meth:`interrupt`, return (or raise) promptly.
        """

    @property
    def ranks(self) -> tuple[int, ...] | None:
        """The ranks this transport drives, once started: ``None`` (the default) for every
        rank. A transport that drives only this process's own rank (SPMD under an external
        launcher) names it; calls then expect a reply from it alone."""
        return None

    def inline_runner(self) -> Callable[..., Any] | None:
        """For a transport that drives one rank in the caller's own process: a function
        ``run(method, args, kwargs)`` that runs a call on it in the calling thread and returns
        its result or raises the worker's exception (the core makes that a ``WorkerError``).
        The core then makes a blocking call without a timeout, while no other call is in
        flight, a plain method call. Asked once, after :meth:`start`; None (the default):
        every call goes through :meth:`send`."""
        return None

    def poll(self, timeout: float | None) -> None:
        """Deliver the replies that are ready; if there are none, wait up to ``timeout``
        seconds (``None``: until one arrives) for one. Only for ``polls = True``; the core
        calls it from one thread at a time. Return promptly after :meth:`interrupt`."""
        raise NotImplementedError(f"{type(self).__name__} sets polls = True but has no poll()")

    def interrupt(self) -> None:  # noqa: B027 - optional: transports that never block need none
        """The executor failed or is closing: wake any thread blocked in :meth:`send` or
        :meth:`poll`. Called at most once, from any thread."""

    def probe(self, ranks: Sequence[int], timeout: float) -> set[int]:
        """A liveness probe: ask each rank's process, apart from whatever it is running, whether
        it still answers; return the ranks that did not within ``timeout`` seconds. Called
        from one thread of the core's while a call has waited longer than
        ``ExecutorConfig.hang_timeout_s``; only for a backend that declares
        ``Capabilities(liveness_probe=True)``. A process busy in a long call, or blocked in a
        collective that released the interpreter, answers; a stopped or frozen one does not."""
        raise NotImplementedError(f"{type(self).__name__} declares no liveness probe")

    def kill(self, ranks: Sequence[int]) -> None:
        """End the processes of ``ranks`` at once (the core declared them hung and has
        already failed the calls in flight). Only with :meth:`probe`."""
        raise NotImplementedError(f"{type(self).__name__} declares no liveness probe")

    def replace(
        self, ranks: Sequence[int], rejoin: Callable[[Sequence[WorkerContext]], None]
    ) -> None:
        """Rank replacement (a backend that declares ``Capabilities(recovery="replace")``):
        start new processes for the dead ``ranks`` while every other rank keeps its process
        and its memory. The core calls it from its recovery thread after the calls in flight
        failed; :attr:`host` is already a fresh :class:`TransportHost` (a new call table, so
        no reply from before the death completes a later call): rebind what held the old
        one, and undo :meth:`interrupt`.

        In order: make every rank's new context (the same places, a new ``torch.distributed``
        rendezvous), start the new ranks' processes with theirs, reading calls from the next
        one sent, then call ``rejoin(contexts)`` (every rank's, in rank order): the core
        sends the rejoin call, which each survivor runs (``WorkerBase.rejoin``) once it has
        finished the calls it still held, and a new rank answers once it has run
        ``init_device`` and ``load_model``; the survivors' bound
        (``RecoveryPolicy.rejoin_timeout_s``) starts then. Then wait, as :meth:`start` does
        and within the same bound, until each new rank is ready, handing any other reply read
        meanwhile to :attr:`TransportHost.deliver`, and end the wait promptly after
        :meth:`interrupt` (the core interrupts a replacement whose survivors are late). Raise
        if it cannot be done (the core then restarts the whole group); raise
        :class:`~executor_core.NodeLostError` if a node the ranks need is gone for good (the
        core then fails the executor at once); the default raises ``NotImplementedError``."""
        raise NotImplementedError(f"{type(self).__name__} cannot replace ranks")

    @abc.abstractmethod
    def close(self, graceful: bool) -> None:
        """Stop the workers; called once by the core. ``graceful``: let each finish its calls
        and run its worker's ``shutdown`` (and the stopping hook), waiting a bounded time, then
        stop what is left by force. Not graceful (after a failure, or from the finalizer):
        stop by force at once. Never block for ever; release memory, sockets and files through
        :meth:`TransportHost.add_cleanup` so that they are released after readers have left.
        """


def can_replace(transport: Transport) -> bool:
    """Whether ``transport`` implements :meth:`Transport.replace` (rank replacement)."""
    return type(transport).replace is not Transport.replace
