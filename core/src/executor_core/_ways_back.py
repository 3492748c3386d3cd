"""The two ways back after a death, which :class:`~executor_core._lifecycle.Lifecycle`
inherits: rank replacement (only the dead ranks get new processes; the survivors rejoin) and
group restart (every rank starts again)."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ._calls import Call
from ._errors import ExecutorClosedError, ExecutorError
from ._transport import can_replace
from ._wire import REJOIN_METHOD

if TYPE_CHECKING:
    from ._config import ExecutorConfig
    from ._host import TransportHost
    from ._recovery import Recovery
    from ._replies import Replies
    from ._sleep import SleepState
    from ._transport import Transport
    from ._worker import WorkerContext

__all__ = ["WaysBack", "log_warning"]


def log_warning(message: str) -> None:
    """Log a warning of the core's (rare paths: a failed replacement, a stuck shutdown)."""
    import logging  # deferred: only needed on this rare path

    logging.getLogger("executor_core").warning(message)


class WaysBack:
    """The recovery thread's attempt after a death (:meth:`_come_back`), and the group
    restart that :meth:`~executor_core.Executor.recover` also runs."""

    if TYPE_CHECKING:  # what the lifecycle that inherits this provides
        config: ExecutorConfig
        _recovery: Recovery
        _host: TransportHost
        _transport: Transport
        _finalizer: weakref.finalize[Any, Any]
        _starting: TransportHost | None
        _all_ranks: tuple[int, ...]
        _next_seq: int
        _replaces: bool | None
        _sleep: SleepState

        @property
        def world_size(self) -> int: ...

        def _new_host(self) -> TransportHost: ...

        def _install(self, first: bool = False) -> None: ...

        _publish: Callable[[TransportHost, Transport, Replies, weakref.finalize[Any, Any]], None]

    def _come_back(self, ranks: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
        """The recovery thread's attempt after the death of ``ranks``: replace them where
        the policy and the transport allow, else (or if that fails) restart every rank.
        Returns what it did: ``(kind, the ranks that got new processes)``."""
        policy = self._recovery.policy
        dead = tuple(sorted(set(ranks) & set(self._all_ranks)))
        if (
            policy is not None
            and policy.replace_ranks
            and dead
            and len(dead) < len(self._all_ranks)
            # Asleep, the survivors and a new rank would disagree: a group restart wakes all.
            and not self._sleep.tags
            and (can_replace(self._transport) if self._replaces is None else self._replaces)
        ):
            try:
                self._replace(dead, policy.rejoin_timeout_s)
                return "replace", dead
            except ExecutorClosedError:
                raise
            except Exception as exc:  # noqa: BLE001 - logged; a group restart follows
                log_warning(
                    f"replacing rank(s) {list(dead)} failed ({type(exc).__name__}: {exc}); "
                    "restarting every rank"
                )
                self._recovery.forget_pending()
        self._restart()
        return "restart", self._all_ranks

    def _replace(self, dead: tuple[int, ...], rejoin_timeout_s: float) -> None:
        """Rank replacement: the transport, and the survivors' processes, carry on over a new
        host (a new call table: no reply from before the death completes a later call);
        new processes take the dead ranks, and every survivor runs the rejoin call."""
        recovery = self._recovery
        old, transport = self._host, self._transport
        if recovery.is_closed() or old.closed:
            raise ExecutorClosedError("the executor has been shut down; create a new one")
        host = self._new_host()
        self._finalizer.detach()
        host.take_over(old)
        transport.host = host
        replies = host.attach(transport)
        finalizer = weakref.finalize(self, host.release, False)
        self._starting = host
        call: Call | None = None

        def rejoin(contexts: Sequence[WorkerContext]) -> None:
            nonlocal call
            call = self._send_rejoin(host, transport, contexts)

        try:
            transport.replace(dead, rejoin)
            if call is None:
                raise ExecutorError(f"{type(transport).__qualname__}.replace never called rejoin")
            # The new ranks are ready: the survivors' bound starts now.
            call.timeout = rejoin_timeout_s
            call.deadline = time.monotonic() + rejoin_timeout_s
            replies.wait(call)
        except BaseException:
            host.restarting = True  # remote agents rejoin the group restart that follows
            finalizer()
            raise
        finally:
            self._starting = None
        if recovery.is_closed():
            finalizer()
            raise ExecutorClosedError("the executor was shut down during its recovery")
        self._publish(host, transport, replies, finalizer)

    def _send_rejoin(
        self,
        host: TransportHost,
        transport: Transport,
        contexts: Sequence[WorkerContext],
    ) -> Call:
        """Send every rank the rejoin call (:data:`REJOIN_METHOD`) with their new contexts
        (no deadline yet: it starts once the new ranks are ready)."""
        if len(contexts) != self.world_size:
            raise ExecutorError(
                f"{type(transport).__qualname__}.replace gave {len(contexts)} contexts for "
                f"{self.world_size} ranks"
            )
        with host.send_lock:
            seq = self._next_seq
            self._next_seq = seq + 1
            call = Call(
                seq=seq,
                method=REJOIN_METHOD,
                name="rejoin",
                args=(tuple(contexts),),
                expected=self._all_ranks,
            )
            host.table.add(call)
            if not transport.send(call):
                host.table.remove(call)
                raise ExecutorError("the rejoin call could not be sent")
        return call

    def _restart(self) -> None:
        """Stop every worker and start them again (a group restart; the recovery thread or
        :meth:`recover` calls it). Raises what the new start raised."""
        recovery = self._recovery
        if recovery.is_closed() or self._host.closed:
            raise ExecutorClosedError("the executor has been shut down; create a new one")
        old = self._host
        self._finalizer.detach()
        old.restarting = True
        old.release(False)  # once: a host whose start (or replacement) failed is released
        if recovery.is_closed():  # shut down while the old workers stopped
            raise ExecutorClosedError("the executor was shut down during its recovery")
        self._install()
