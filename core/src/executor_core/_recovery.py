"""An executor's workers over their life: started, failed, brought back, shut down.

:class:`Recovery` owns the rules of recovery for every backend: the states
(:class:`ExecutorState`), the policy's budget, what happens to calls in flight at a death
(they fail with ``WorkerDiedError``, never replayed), the order in which a death is reported
(the ``executor_worker_died`` hook, the state, the failure callbacks when it is final, and
only then the calls' errors), and the two ways back: rank replacement (new processes for
the dead ranks; the survivors rejoin) and group restart (every rank anew, over a new
:class:`TransportHost`). :class:`HangWatch` declares a rank that stops answering dead.

It holds the executor's class, never the executor: the executor's finalizer holds this
object, so an executor dropped without ``shutdown()`` is still collected, and its workers
are stopped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ._calls import Call
from ._config import ExecutorConfig, ExecutorState, RecoveryRecord
from ._errors import (
    ConfigError,
    ExecutorClosedError,
    ExecutorError,
    ExecutorFailedError,
    NodeLostError,
    WorkerDiedError,
)
from ._transport import Transport, TransportHost, run_logged
from ._wrapper import REJOIN_METHOD

if TYPE_CHECKING:
    import pluggy

    from ._calls import Replies
    from ._executor import Executor
    from ._worker import WorkerContext

__all__ = ["FailureCallback", "HangWatch", "Recovery"]

logger = logging.getLogger("executor_core")

#: Called once with the error when the executor fails for good.
FailureCallback = Callable[[ExecutorFailedError], None]
#: How long shutdown waits for a send in progress before it stops the workers by force.
_SEND_LOCK_S = 5.0
#: A probe waits at least this long for an answer, and at most the second.
_MIN_PROBE_S, _MAX_PROBE_S = 0.5, 5.0


class _RejoinTimeout(ExecutorError):
    """A rank replacement given up: survivors did not rejoin within the policy's bound."""


class Recovery:
    """One executor's workers and their state (see the module). Thread-safe."""

    def __init__(
        self, cls: type[Executor], config: ExecutorConfig, name: str, hooks: pluggy.HookRelay
    ) -> None:
        self._cls, self.config, self.name, self._hooks = cls, config, name, hooks
        self.policy = config.recovery
        #: Whether a death is answered by replacing ranks (the backend's spec), or None for a
        #: class no plugin declares (then: if its transport implements ``replace``).
        self.replaces: bool | None = None
        self._cond = threading.Condition()
        self.state = ExecutorState.RUNNING
        #: The error the executor failed with for good (state FAILED), else None.
        self.final: ExecutorFailedError | None = None
        self._callbacks: list[FailureCallback] = []
        self._starts: deque[float] = deque()  # when recoveries started, within the window
        #: Set by ``Executor.fail``: that failure is the user's, not to be recovered.
        self.refuse_next = False
        #: A death reported while a recovery ran: the next one to recover from.
        self._pending: ExecutorFailedError | None = None
        self._start_pending = False
        self._thread: threading.Thread | None = None
        #: The death the recovery in progress (or the last one) answers, and its ranks.
        self.last_death: WorkerDiedError | None = None
        self.recovering_ranks: tuple[int, ...] = ()
        #: The last completed recovery.
        self.last: RecoveryRecord | None = None
        # The incarnation calls go to, published once its workers are ready.
        self.host: TransportHost = TransportHost(config, name, hooks)  # closed until started
        self.host._closed = True
        self.transport: Transport | None = None
        self.replies: Replies | None = None
        self.ranks: tuple[int, ...] = tuple(range(config.world_size))
        #: execute_model's reply rank and the ranks it waits for.
        self.step_reply: tuple[int | None, tuple[int, ...]] = (None, self.ranks)
        self.run_inline: Callable[..., Any] | None = None
        #: The sleep tags asleep now (``Executor.sleep``).
        self.sleeping: set[str] = set()
        #: The next call's sequence number (taken under the host's send lock).
        self.next_seq = 1
        self._starting: TransportHost | None = None
        self._kept: dict[str, tuple[Any, Callable[[], None]]] = {}

    # --- starting workers --------------------------------------------------------------------

    def _new_host(self) -> TransportHost:
        host = TransportHost(self.config, self.name, self._hooks, self)
        host._kept = self._kept
        return host

    def install(self, first: bool = False) -> None:
        """Build a host and a transport over it and start the workers: at creation, and for
        each group restart (nothing of the old host is reused, so no reply from before a
        death reaches a call made after it)."""
        host = self._new_host()
        transport = self._cls._create_transport(host)
        if self.config.hang_timeout_s is not None and not transport.can_probe():
            raise ConfigError(
                "hang_timeout_s",
                self.config.hang_timeout_s,
                f"{type(transport).__qualname__} has no liveness probe (Transport.probe); "
                "leave hang_timeout_s=None",
            )
        replies = host._attach(transport)
        self._starting = host  # published only once started
        try:
            transport.start()
        except BaseException:
            host._closed = first  # nobody will see it: calls on it would find it closed
            host.restarting = not first  # a recovery's attempt: the next one may follow
            host._release(False)
            raise
        finally:
            self._starting = None
        if self.is_closed() and not first:  # dropped during the recovery: stop them again
            host._release(False)
            raise ExecutorClosedError("the executor was shut down during its recovery")
        driven = transport.ranks
        self.ranks = tuple(driven) if driven is not None else tuple(range(self.config.world_size))
        output = self.config.output_rank
        self.step_reply = (output, (output,)) if output in self.ranks else (None, self.ranks)
        self._publish(host, transport, replies)
        self.run_inline = transport.inline_runner() if len(self.ranks) == 1 else None

    def _publish(self, host: TransportHost, transport: Transport, replies: Replies) -> None:
        self.host, self.transport, self.replies = host, transport, replies
        bound = self.config.hang_timeout_s
        if bound is not None:
            host._hang_watch = HangWatch(host, transport, self.ranks, bound)
            host._hang_watch.start()

    # --- a failure (the host calls these) -----------------------------------------------------

    def failing(self, host: TransportHost, error: ExecutorFailedError) -> None:
        """``host`` fails with ``error``, before its calls do: report the death, decide (the
        state is recovering or failed from now on), and if it is final run the callbacks."""
        if isinstance(error, WorkerDiedError):
            try:
                self._hooks.executor_worker_died(
                    backend=self.name, ranks=tuple(error.ranks), node=error.node, error=error
                )
            except Exception:
                logger.exception("an implementation of executor_worker_died raised")
        with self._cond:
            final = self._choose(error)
        if final is not None:
            self._fail_for_good(final)

    def failed(self, error: ExecutorFailedError) -> None:
        """The host's calls have failed: start the recovery that :meth:`failing` decided."""
        with self._cond:
            if not self._start_pending:
                return
            self._start_pending = False
            self._thread = threading.Thread(
                target=self._run, args=(self.last_death,), name=f"executor-{self.name}-recovery"
            )
            self._thread.daemon = True
            self._thread.start()

    def _choose(self, error: ExecutorFailedError) -> ExecutorFailedError | None:
        """Under the lock: the error to fail for good with, or None (recovering, or nothing
        to do); enters the recovering state when the policy allows one."""
        if self.state is ExecutorState.CLOSED:
            return None
        if self.state is ExecutorState.RECOVERING:
            # A host of the recovery failed after its start: the recovery takes it next.
            self._pending = error
            self._cond.notify_all()
            return None
        refused, self.refuse_next = self.refuse_next, False
        policy = self.policy
        if policy is None or refused or not isinstance(error, WorkerDiedError):
            return error
        if not self._take_budget():
            final = ExecutorFailedError(
                f"{error}; the recovery policy allows {policy.max_restarts} recoveries "
                f"within {policy.window_s:g} s, and they are used up"
            )
            final.__cause__ = error
            return final
        self.state = ExecutorState.RECOVERING
        self.recovering_ranks, self.last_death = tuple(error.ranks), error
        self._start_pending = True
        return None

    def _take_budget(self) -> bool:
        assert self.policy is not None
        now = time.monotonic()
        while self._starts and now - self._starts[0] > self.policy.window_s:
            self._starts.popleft()
        if len(self._starts) >= self.policy.max_restarts:
            return False
        self._starts.append(now)
        return True

    def _fail_for_good(self, error: ExecutorFailedError) -> None:
        with self._cond:
            if self.state is ExecutorState.CLOSED:
                return
            self.state, self.final = ExecutorState.FAILED, error
            callbacks, self._callbacks = self._callbacks, []
            self._cond.notify_all()
        for callback in callbacks:
            run_logged(f"the failure callback {callback!r}", callback, error)

    # --- the recovery thread ------------------------------------------------------------------

    def _run(self, error: WorkerDiedError) -> None:
        policy = self.policy
        assert policy is not None
        self._hook("executor_recovery_started", ranks=tuple(error.ranks), error=error)
        started, delay = time.perf_counter(), 0.0
        while True:
            with self._cond:
                if delay:
                    self._cond.wait_for(self.is_closed, delay)
                if self.is_closed():
                    return
            try:
                did = self._come_back(tuple(error.ranks))
            except ExecutorClosedError:
                return
            except NodeLostError as lost:  # no attempt can succeed: fail now, saying why
                logger.error("recovering the %s executor: %s", self.name, lost)
                lost.__context__ = error
                self._fail_for_good(lost)
                return
            except Exception as exc:  # noqa: BLE001 - the attempt failed: retry or fail for good
                logger.warning("recovering the %s executor failed: %s", self.name, exc)
                self._forget_pending()  # a death of that attempt's workers is no news
                with self._cond:
                    if self.is_closed():
                        return
                    out_of_budget = not self._take_budget()
                if out_of_budget:
                    final = ExecutorFailedError(
                        f"recovering from {error} failed ({exc}), and the recovery policy "
                        f"allows no more attempts ({policy.max_restarts} within "
                        f"{policy.window_s:g} s)"
                    )
                    final.__cause__ = exc
                    self._fail_for_good(final)
                    return
                delay = 2 * delay if delay else policy.backoff_s
                continue
            with self._cond:
                pending, self._pending = self._pending, None
                again = isinstance(pending, WorkerDiedError) and self._take_budget()
            if pending is not None and not again:
                self._fail_for_good(pending)
                return
            if isinstance(pending, WorkerDiedError):  # died again right after: once more
                error, delay = pending, policy.backoff_s
                continue
            self._recovered(tuple(error.ranks), time.perf_counter() - started, did)
            return

    def _forget_pending(self) -> None:
        """An attempt failed and another starts: a death reported meanwhile was of the failed
        attempt's workers (a failure that is not a death still ends the recovery)."""
        with self._cond:
            if isinstance(self._pending, WorkerDiedError):
                self._pending = None

    def is_closed(self) -> bool:
        """True once the executor is shut down."""
        return self.state is ExecutorState.CLOSED

    def _recovered(
        self, ranks: tuple[int, ...], duration_s: float, did: tuple[str, tuple[int, ...], str]
    ) -> None:
        with self._cond:
            if self.state is not ExecutorState.RECOVERING:  # shut down meanwhile
                return
            pending, self._pending = self._pending, None
            if pending is None:
                self.state = ExecutorState.RUNNING
                kind, restarted, reason = did
                self.last = RecoveryRecord(
                    ranks=ranks,
                    restarted=restarted,
                    kind=kind,
                    duration_s=duration_s,
                    reason=reason,
                )
                self._cond.notify_all()
        if pending is not None:  # died again as this recovery ended: no budget to decide
            self._fail_for_good(pending)
            return
        self._hook("executor_recovered", ranks=ranks, duration_s=duration_s)

    def _hook(self, name: str, **kwargs: Any) -> None:
        try:
            getattr(self._hooks, name)(backend=self.name, **kwargs)
        except Exception:
            logger.exception("an implementation of %s raised", name)

    # --- the two ways back --------------------------------------------------------------------

    def _come_back(self, ranks: tuple[int, ...]) -> tuple[str, tuple[int, ...], str]:
        """One attempt after the death of ``ranks``: replace them where the policy and the
        transport allow, else (or if that fails) restart every rank. Returns ``(kind, the
        ranks that got new processes, why every rank was restarted where they could have been
        replaced, or "")``."""
        policy = self.policy
        dead = tuple(sorted(set(ranks) & set(self.ranks)))
        reason = ""
        replaces = self.replaces
        if replaces is None:
            replaces = self.transport is not None and self.transport.can_replace()
        if policy and policy.replace_ranks and dead and len(dead) < len(self.ranks) and replaces:
            if self.sleeping:  # the survivors and a new rank would disagree: restart all
                reason = "the executor was asleep (a group restart wakes every rank)"
            else:
                try:
                    self._replace(dead, policy.rejoin_timeout_s)
                    return "replace", dead, ""
                except (ExecutorClosedError, NodeLostError):
                    raise
                except Exception as exc:  # noqa: BLE001 - logged; a group restart follows
                    reason = f"replacing rank(s) {list(dead)} failed: {exc}"
                    logger.warning("%s; restarting every rank", reason)
                    self._forget_pending()
        self._restart()
        return "restart", self.ranks, reason

    def _replace(self, dead: tuple[int, ...], rejoin_timeout_s: float) -> None:
        """Rank replacement: the transport and the survivors' processes carry on over a new
        host (a new call table: no reply from before the death completes a later call); new
        processes take the dead ranks, and every rank runs the rejoin call."""
        old, transport = self.host, self.transport
        assert transport is not None
        if self.is_closed() or old._closed:
            raise ExecutorClosedError("the executor has been shut down; create a new one")
        host = self._new_host()
        host._take_over(old)
        transport.host = host
        replies = host._attach(transport)
        self._starting = host
        survivors = tuple(rank for rank in self.ranks if rank not in dead)
        call: Call | None = None
        watch: threading.Timer | None = None

        def rejoin(contexts: Sequence[WorkerContext]) -> None:
            nonlocal call, watch
            call = self._send_rejoin(host, transport, contexts)
            # The survivors' bound starts now: the new ranks' processes have started, and a
            # survivor still in an earlier call holds up their rendezvous.
            args = (host, call, survivors, rejoin_timeout_s)
            watch = threading.Timer(rejoin_timeout_s, _abandon_if_late, args)
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
            abandoned = host._table.closed_error
            host.restarting = True  # remote agents rejoin the group restart that follows
            host._release(False)
            self.host = host  # released: the restart that follows starts anew
            if isinstance(abandoned, _RejoinTimeout) and exc is not abandoned:
                raise abandoned from exc  # why the transport's wait ended
            raise
        finally:
            if watch is not None:
                watch.cancel()
            self._starting = None
        if self.is_closed():
            host._release(False)
            raise ExecutorClosedError("the executor was shut down during its recovery")
        self._publish(host, transport, replies)

    def _send_rejoin(
        self, host: TransportHost, transport: Transport, contexts: Sequence[WorkerContext]
    ) -> Call:
        """Send every rank the rejoin call with their new contexts."""
        if len(contexts) != self.config.world_size:
            raise ExecutorError(
                f"{type(transport).__qualname__}.replace gave {len(contexts)} contexts for "
                f"{self.config.world_size} ranks"
            )
        with host._send_lock:
            call = Call(
                seq=self.next_seq,
                method=REJOIN_METHOD,
                name="rejoin",
                args=(tuple(contexts),),
                expected=self.ranks,
            )
            self.next_seq += 1
            host._table.add(call)
            if not transport.send(call):
                host._table.remove(call)
                raise ExecutorError("the rejoin call could not be sent")
        return call

    def _restart(self) -> None:
        """Stop every worker and start them again (a group restart)."""
        if self.is_closed() or self.host._closed:
            raise ExecutorClosedError("the executor has been shut down; create a new one")
        old = self.host
        old.restarting = True
        old._release(False)  # once: a host whose start or replacement failed is released
        if self.is_closed():  # shut down while the old workers stopped
            raise ExecutorClosedError("the executor was shut down during its recovery")
        self.install()

    # --- the executor's calls -----------------------------------------------------------------

    def register(self, callback: FailureCallback) -> None:
        """Run ``callback(error)`` once when the executor fails for good (now if it has)."""
        with self._cond:
            final = self.final if self.state is ExecutorState.FAILED else None
            if final is None:
                self._callbacks.append(callback)
                return
        run_logged(f"the failure callback {callback!r}", callback, final)

    def wait(self, timeout: float | None) -> ExecutorState:
        """Wait while a recovery runs (at most ``timeout`` seconds); the state then."""
        with self._cond:
            self._cond.wait_for(lambda: self.state is not ExecutorState.RECOVERING, timeout)
            return self.state

    def recover(self, timeout: float | None) -> None:
        """``Executor.recover``: a group restart now, or wait for the recovery that runs."""
        from ._errors import RPCTimeoutError

        with self._cond:
            if self.is_closed() or self.host._closed:
                raise ExecutorClosedError("the executor has been shut down; create a new one")
            running = self.state is ExecutorState.RECOVERING
            if not running:
                self.state, self.final = ExecutorState.RECOVERING, None
        if running:
            if self.wait(timeout) is ExecutorState.RECOVERING:
                raise RPCTimeoutError("recover", list(self.ranks), timeout or 0.0)
            if self.state is ExecutorState.FAILED:
                assert self.final is not None
                raise self.final
            return
        ranks = tuple(getattr(self.host._failure, "ranks", ()) or self.ranks)
        start = time.perf_counter()
        try:
            self._restart()
        except ExecutorClosedError:
            raise
        except Exception as exc:
            error = ExecutorFailedError(f"recovering the executor failed: {exc}")
            error.__cause__ = exc
            self._fail_for_good(error)
            raise error from exc
        self._recovered(ranks, time.perf_counter() - start, ("restart", self.ranks, ""))

    def shutdown(self) -> None:
        """``Executor.shutdown``: end the recovery, stop the workers, release everything."""
        if self._starting is not None:  # a start in progress gives up at once
            self._starting._abort(ExecutorClosedError("the executor was shut down"))
        with self._cond:
            self.state = ExecutorState.CLOSED
            self._callbacks.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(60.0)
            if thread.is_alive():
                logger.warning("the recovery thread did not end; its workers are left to it")
        host = self.host
        with host._state_lock:
            if host._closed:
                return
            host._closed = True
        # Graceful only if no send is stuck: the stop must not interleave with a call.
        graceful = host._failure is None and host._send_lock.acquire(timeout=_SEND_LOCK_S)
        try:
            host._release(graceful)
        finally:
            if graceful:
                host._send_lock.release()
            self._release_kept()

    def drop(self) -> None:
        """The executor was dropped without ``shutdown()`` (its finalizer): stop by force."""
        with self._cond:
            self.state = ExecutorState.CLOSED
            self._cond.notify_all()
        self.host._release(False)
        self._release_kept()

    def _release_kept(self) -> None:
        """Release what the transports kept and no incarnation took back, in keeping order."""
        while self._kept:
            name = next(iter(self._kept))
            run_logged(f"releasing kept {name!r}", self._kept.pop(name)[1])


def _abandon_if_late(
    host: TransportHost, call: Call, survivors: tuple[int, ...], bound: float
) -> None:
    """The rejoin bound has passed: if a survivor has not answered the rejoin call, abort the
    replacement's host (the transport's wait ends, and the core restarts every rank)."""
    late = [rank for rank in survivors if rank not in call.results]
    if late and not call.done:
        host._abort(
            _RejoinTimeout(
                f"survivor rank(s) {late} did not rejoin within rejoin_timeout_s={bound:g} s "
                "of the new ranks' start (still in an earlier call, or not answering)"
            )
        )


class HangWatch:
    """Declares the ranks of one host dead once they stop answering
    (``ExecutorConfig.hang_timeout_s``).

    One thread per running host, started only when a bound is set. It looks at the oldest
    call in flight every quarter of the bound; once that call has waited the bound, it probes
    every rank at each look. A rank that answered none of those probes for the bound is
    declared dead: the host fails with a :class:`WorkerDiedError` that says it hung, and the
    transport kills the process. Ranks that answer are left alone, however long their call.
    The probe tells a live process from a frozen one, not a useful call from a useless one
    (docs/recovery.md, "Hangs").
    """

    def __init__(
        self, host: TransportHost, transport: Transport, ranks: Sequence[int], bound_s: float
    ) -> None:
        self._host, self._transport = host, transport
        self._ranks, self.bound_s = tuple(ranks), bound_s
        #: How often it looks at the oldest call, and how long a probe waits for answers.
        self.tick_s = bound_s / 4
        self.probe_s = min(max(self.tick_s, _MIN_PROBE_S), _MAX_PROBE_S)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="executor-hangs", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the thread (it exits at its next wake-up, which this brings forward)."""
        self._stop.set()

    def _run(self) -> None:
        table = self._host._table
        seen_seq, seen_at = 0, 0.0
        #: Rank -> when the first of the probes it has not answered since was sent.
        silent_since: dict[int, float] = {}
        while not self._stop.wait(self.tick_s) and table.closed_error is None:
            with table.lock:
                oldest = next(iter(table.calls.values()), None)
            now = time.monotonic()
            if oldest is None or oldest.seq != seen_seq:
                seen_seq, seen_at = (0, now) if oldest is None else (oldest.seq, now)
                silent_since.clear()
                continue
            if now - seen_at < self.bound_s:
                continue
            try:
                with self._host._probe_lock:
                    silent = self._transport.probe(self._ranks, self.probe_s)
            except Exception:
                logger.exception("the liveness probe failed")
                continue
            for rank in [rank for rank in silent_since if rank not in silent]:
                del silent_since[rank]  # it answered: alive, however long its call
            for rank in silent:
                if rank in self._ranks:
                    silent_since.setdefault(rank, now)
            done = time.monotonic()
            hung = sorted(r for r, since in silent_since.items() if done - since >= self.bound_s)
            with table.lock:
                # The call may have completed during the probe (its ranks answered it, so
                # they were alive then): the next call in flight starts a watch of its own.
                if table.calls.get(oldest.seq) is not oldest:
                    continue
                hung = [rank for rank in hung if rank in oldest.missing()]
            if hung and table.closed_error is None:
                self._declare(hung, oldest.name, done - seen_at, done - silent_since[hung[0]])
                return

    def _declare(self, ranks: list[int], call: str, waited: float, silent: float) -> None:
        detail = (
            f"hung: no reply to {call} for {waited:.1f} s and no answer to a liveness probe "
            f"for {silent:.1f} s (hang_timeout_s={self.bound_s:g}); killed"
        )
        node = self._host._node_named(ranks)
        died = WorkerDiedError(ranks[0], detail=detail, ranks=tuple(ranks), node=node)
        self._host.worker_died(died)
        run_logged(f"killing hung ranks {ranks}", self._transport.kill, ranks)
