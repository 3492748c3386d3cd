"""Recovery: an executor whose workers died comes back, by the rules of its policy.

The core owns the rules, for every backend that can start its workers again: the states
(:class:`ExecutorState`), the budget of restarts (:class:`RecoveryPolicy`), what happens to
calls in flight at a death (they fail with ``WorkerDiedError`` naming the ranks, never
replayed) and to calls made meanwhile (they wait for the recovery, bounded by their own
timeout, or fail at once with :class:`~executor_core.RecoveringError`), and when the failure
callbacks run (once, when the executor fails for good). The backend's part is to start its
workers again: today every rank (a group restart: fresh processes, fresh contexts, a new
``torch.distributed`` rendezvous, ``init_device`` and ``load_model`` again), by building its
transport anew over a new :class:`~executor_core.backend.TransportHost`.

One :class:`Recovery` per executor watches each of its hosts in turn (a failure callback of
the host) and holds no reference to the executor: the restart is reached through a weak
method, so that a dropped executor is still collected and stopped by its finalizer.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._errors import ExecutorClosedError, ExecutorFailedError, NodeLostError, WorkerDiedError
from ._recovery_policy import ExecutorState, RecoveryPolicy, RecoveryRecord

if TYPE_CHECKING:
    import pluggy

__all__ = ["Recovery"]

logger = logging.getLogger("executor_core")

#: Called once with the error when the executor fails for good.
FailureCallback = Callable[[ExecutorFailedError], None]


class Recovery:
    """The recovery state of one executor (see the module docstring). Thread-safe."""

    def __init__(
        self,
        policy: RecoveryPolicy | None,
        backend: str,
        hooks: pluggy.HookRelay,
        restart: Callable[[tuple[int, ...]], tuple[str, tuple[int, ...], str]],
    ) -> None:
        self.policy = policy
        self._backend = backend
        self._hooks = hooks
        self._restart = weakref.WeakMethod(restart)
        self._cond = threading.Condition()
        self.state = ExecutorState.RUNNING
        #: The error the executor failed with for good (state FAILED), else None.
        self.final: ExecutorFailedError | None = None
        self._callbacks: list[FailureCallback] = []
        #: When recoveries started, within the policy's window.
        self._starts: deque[float] = deque()
        #: Set by ``Executor.fail``: that failure is the user's, not to be recovered.
        self.refuse_next = False
        #: A death reported while a recovery was finishing: the next one to recover from.
        self._pending: ExecutorFailedError | None = None
        #: The ranks whose death the recovery in progress (or the last one) answers.
        self.recovering_ranks: tuple[int, ...] = ()
        #: The death the recovery in progress (or the last one) answers.
        self.last_death: WorkerDiedError | None = None
        self._thread: threading.Thread | None = None
        #: A recovery was decided and its thread is still to start.
        self._start_pending = False
        #: The last completed recovery, or None.
        self.last: RecoveryRecord | None = None
        #: What the attempt in progress did: ``(kind, restarted ranks, reason)``.
        self._did: tuple[str, tuple[int, ...], str] = ("restart", (), "")

    # --- the executor's hosts call these -------------------------------------------------

    def decide(self, error: ExecutorFailedError) -> None:
        """A host is failing with ``error`` (a failure callback, run before it fails its calls):
        decide now, so that whoever sees the error sees the executor recovering or failed
        already. Failing for good, the failure callbacks run here too, before any caller
        gets the error (a ``shutdown()`` right after it loses none). Nothing else can
        interleave: :meth:`begin_explicit` finds the state this sets."""
        with self._cond:
            final = self._choose(error)
        if final is not None:
            self._fail_for_good(final)

    def on_failure(self, error: ExecutorFailedError) -> None:
        """A host has failed its calls (its ``after_abort``; any thread): start the recovery
        thread that :meth:`decide` called for, if it did."""
        with self._cond:
            if not self._start_pending:
                return
            self._start_pending = False
            self._thread = threading.Thread(
                target=self._run,
                args=(self.last_death,),
                name=f"executor-{self._backend}-recovery",
                daemon=True,
            )
            self._thread.start()

    def _choose(self, error: ExecutorFailedError) -> ExecutorFailedError | None:
        """Under the lock: the error to fail for good with, or None (recovering, or nothing
        to do); enters the recovering state when the policy allows one."""
        if self.state is ExecutorState.CLOSED:
            return None
        if self.state is ExecutorState.RECOVERING:
            # A host of the recovery itself failed after its start: the recovery thread
            # takes it as the next death (an explicit recover() ends and this one fails).
            self._pending = error
            self._cond.notify_all()
            return None
        refused = self.refuse_next
        self.refuse_next = False
        policy = self.policy
        if policy is None or refused or not isinstance(error, WorkerDiedError):
            return error
        if not self._take_budget(policy):
            final = ExecutorFailedError(
                f"{error}; the recovery policy allows {policy.max_restarts} recoveries "
                f"within {policy.window_s:g} s, and they are used up"
            )
            final.__cause__ = error
            return final
        self.state = ExecutorState.RECOVERING
        self.recovering_ranks = tuple(error.ranks)
        self.last_death = error
        self._start_pending = True  # by on_failure, once the host has failed its calls
        return None

    def _take_budget(self, policy: RecoveryPolicy) -> bool:
        now = time.monotonic()
        while self._starts and now - self._starts[0] > policy.window_s:
            self._starts.popleft()
        if len(self._starts) >= policy.max_restarts:
            return False
        self._starts.append(now)
        return True

    def _fail_for_good(self, error: ExecutorFailedError) -> None:
        with self._cond:
            if self.state is ExecutorState.CLOSED:
                return
            self.state = ExecutorState.FAILED
            self.final = error
            callbacks, self._callbacks = self._callbacks, []
            self._cond.notify_all()
        from ._host import run_callback

        for callback in callbacks:
            run_callback(callback, error)

    # --- the recovery thread ---------------------------------------------------------------

    def _run(self, error: WorkerDiedError) -> None:
        policy = self.policy
        assert policy is not None
        self._hook("executor_recovery_started", ranks=tuple(error.ranks), error=error)
        started = time.perf_counter()
        delay = 0.0
        while True:
            with self._cond:
                if delay:
                    self._cond.wait_for(self.is_closed, delay)
                if self.is_closed():
                    return
            restart = self._restart()
            if restart is None:  # the executor was dropped: its finalizer stops what is left
                return
            try:
                self._did = restart(tuple(error.ranks))
            except ExecutorClosedError:
                return
            except NodeLostError as lost:  # no attempt can succeed: fail now, saying why
                del restart
                logger.error("recovering the %s executor: %s", self._backend, lost)
                lost.__context__ = error
                self._fail_for_good(lost)
                return
            except Exception as exc:  # noqa: BLE001 - the attempt failed: retry or fail for good
                del restart
                logger.warning("recovering the %s executor failed: %s", self._backend, exc)
                self.forget_pending()  # a death of that attempt's workers: the next one follows
                with self._cond:
                    if self.is_closed():
                        return
                    out_of_budget = not self._take_budget(policy)
                if out_of_budget:
                    final = ExecutorFailedError(
                        f"recovering from {error} failed ({exc}), and the recovery policy "
                        f"allows no more attempts ({policy.max_restarts} within "
                        f"{policy.window_s:g} s)"
                    )
                    final.__cause__ = exc
                    self._fail_for_good(final)
                    return
                delay = policy.backoff_s if not delay else 2 * delay
                continue
            del restart
            with self._cond:
                pending, self._pending = self._pending, None
                if pending is not None and (
                    not isinstance(pending, WorkerDiedError) or not self._take_budget(policy)
                ):
                    give_up: ExecutorFailedError | None = pending
                else:
                    give_up = None
            if give_up is not None:
                self._fail_for_good(give_up)
                return
            if pending is not None:  # died again right after the restart: once more
                assert isinstance(pending, WorkerDiedError)
                error, delay = pending, policy.backoff_s
                continue
            self._recovered(tuple(error.ranks), time.perf_counter() - started)
            return

    def forget_pending(self) -> None:
        """An attempt failed and another starts: a death reported meanwhile was of the failed
        attempt's workers, not news for the next one."""
        with self._cond:
            pending, self._pending = self._pending, None
        if pending is not None and not isinstance(pending, WorkerDiedError):
            with self._cond:  # not a death (fail(), say): it still ends the recovery
                self._pending = pending

    def is_closed(self) -> bool:
        """True once the executor is shut down."""
        return self.state is ExecutorState.CLOSED

    def _recovered(self, ranks: tuple[int, ...], duration_s: float) -> None:
        with self._cond:
            if self.state is not ExecutorState.RECOVERING:  # shut down meanwhile
                return
            pending, self._pending = self._pending, None
            if pending is None:
                self.state = ExecutorState.RUNNING
                kind, restarted, reason = self._did
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
            getattr(self._hooks, name)(backend=self._backend, **kwargs)
        except Exception:  # an observer never breaks recovery: logged
            logger.exception("an implementation of %s raised", name)

    # --- the executor's calls --------------------------------------------------------------

    def register(self, callback: FailureCallback) -> None:
        """Run ``callback(error)`` once when the executor fails for good (now if it has)."""
        with self._cond:
            final = self.final if self.state is ExecutorState.FAILED else None
            if final is None:
                self._callbacks.append(callback)
                return
        from ._host import run_callback

        run_callback(callback, final)

    def wait(self, timeout: float | None) -> ExecutorState:
        """Wait while a recovery runs (at most ``timeout`` seconds; None: until it ends);
        the state then."""
        with self._cond:
            self._cond.wait_for(lambda: self.state is not ExecutorState.RECOVERING, timeout)
            return self.state

    def begin_explicit(self) -> bool:
        """``Executor.recover()``: take the recovery over from this thread; False if one runs
        already (then :meth:`wait` for it)."""
        with self._cond:
            if self.state is ExecutorState.CLOSED:
                raise ExecutorClosedError("the executor has been shut down; create a new one")
            if self.state is ExecutorState.RECOVERING:
                return False
            self.state = ExecutorState.RECOVERING
            self.final = None
            return True

    def end_explicit(
        self,
        error: ExecutorFailedError | None,
        ranks: tuple[int, ...],
        took: float,
        did: tuple[str, tuple[int, ...], str] = ("restart", (), ""),
    ) -> None:
        """The explicit recovery ended: recovered (``error`` None; ``did`` is what it did)
        or failed for good."""
        if error is None:
            self._did = did
            self._recovered(ranks, took)
        else:
            self._fail_for_good(error)

    def close(self, timeout: float) -> threading.Thread | None:
        """Shutdown: no more recovery; returns the recovery thread if one runs (the caller
        joins it, at most ``timeout``)."""
        with self._cond:
            self.state = ExecutorState.CLOSED
            self._callbacks.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            return thread if thread.is_alive() else None
        return None
