"""The two ways back after a death, which :class:`~executor_core._lifecycle.Lifecycle`
inherits: rank replacement (only the dead ranks get new processes; the survivors rejoin) and
group restart (every rank starts again)."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ._calls import Call
from ._errors import ExecutorClosedError, ExecutorError, NodeLostError
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


class _RejoinTimeout(ExecutorError):
    """A rank replacement given up: survivors did not rejoin within the policy's bound."""


def _abandon_if_late(
    host: TransportHost, call: Call, survivors: tuple[int, ...], bound_s: float
) -> None:
    """The rejoin bound has passed: if a survivor has not answered the rejoin call, give the
    replacement up (its host is aborted: the transport's wait for the new ranks ends, and
    the core restarts every rank)."""
    late = [rank for rank in survivors if rank not in call.results]
    if late and not call.done:
        host.abort(
            _RejoinTimeout(
                f"survivor rank(s) {late} did not rejoin within rejoin_timeout_s={bound_s:g} s "
                "of the new ranks' start (still in an earlier call, or not answering)"
            )
        )


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

    def _come_back(self, ranks: tuple[int, ...]) -> tuple[str, tuple[int, ...], str]:
        """The recovery thread's attempt after the death of ``ranks``: replace them where
        the policy and the transport allow, else (or if that fails) restart every rank.
        Returns what it did: ``(kind, the ranks that got new processes, why every rank was
        restarted where the ranks could have been replaced, or "")``."""
        policy = self._recovery.policy
        dead = tuple(sorted(set(ranks) & set(self._all_ranks)))
        reason = ""
        if (
            policy is not None
            and policy.replace_ranks
            and dead
            and len(dead) < len(self._all_ranks)
            and (can_replace(self._transport) if self._replaces is None else self._replaces)
        ):
            if self._sleep.tags:
                # Asleep, the survivors and a new rank would disagree: a restart wakes all.
                reason = "the executor was asleep (a group restart wakes every rank)"
            else:
                try:
                    self._replace(dead, policy.rejoin_timeout_s)
                    return "replace", dead, ""
                except (ExecutorClosedError, NodeLostError):
                    raise
                except Exception as exc:  # noqa: BLE001 - logged; a group restart follows
                    reason = f"replacing rank(s) {list(dead)} failed: {exc}"
                    log_warning(f"{reason}; restarting every rank")
                    self._recovery.forget_pending()
        self._restart()
        return "restart", self._all_ranks, reason

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

        survivors = tuple(rank for rank in self._all_ranks if rank not in dead)
        watch: threading.Timer | None = None

        def rejoin(contexts: Sequence[WorkerContext]) -> None:
            nonlocal call, watch
            call = self._send_rejoin(host, transport, contexts)
            # The survivors' bound starts now, as the new ranks' processes have started:
            # a survivor still in an earlier call holds up their rendezvous, so past the
            # bound the replacement is abandoned for a group restart.
            watch = threading.Timer(
                rejoin_timeout_s, _abandon_if_late, (host, call, survivors, rejoin_timeout_s)
            )
            watch.daemon = True
            watch.start()

        try:
            transport.replace(dead, rejoin)
            if call is None:
                raise ExecutorError(f"{type(transport).__qualname__}.replace never called rejoin")
            # The new ranks are ready: they answer the rejoin call at once.
            call.timeout = rejoin_timeout_s
            call.deadline = time.monotonic() + rejoin_timeout_s
            replies.wait(call)
        except BaseException as exc:
            host.restarting = True  # remote agents rejoin the group restart that follows
            finalizer()
            abandoned = host.table.closed_error
            if isinstance(abandoned, _RejoinTimeout) and exc is not abandoned:
                raise abandoned from exc  # why the transport's wait ended
            raise
        finally:
            if watch is not None:
                watch.cancel()
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
