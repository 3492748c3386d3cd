"""The core's recovery rules, on an in-process transport whose "workers" answer every call
at once and die when the test says: states, the policy's budget and backoff, calls made
during a recovery, the hooks, ``recover()``, and no reply from before a death."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from typing import Any, ClassVar

import pytest

from executor_core import (
    ConfigError,
    Executor,
    ExecutorConfig,
    ExecutorFailedError,
    ExecutorState,
    RecoveringError,
    RecoveryPolicy,
    RPCTimeoutError,
    WorkerBase,
    WorkerDiedError,
    hookimpl,
)
from executor_core.backend import Call, Registry, Transport, TransportHost


class _Worker(WorkerBase):
    pass


class _Answering(Transport):
    """Answers each call with ``(start number, rank)``; ``hold`` blocks its start."""

    starts: ClassVar[int] = 0
    made: ClassVar[list[_Answering]] = []
    hold: ClassVar[threading.Event | None] = None
    fail_starts: ClassVar[int] = 0

    def __init__(self, host: TransportHost) -> None:
        super().__init__(host)
        self.closed: bool | None = None
        _Answering.made.append(self)

    def start(self) -> None:
        hold = self.hold
        if hold is not None:
            assert hold.wait(10)
        if _Answering.fail_starts:
            _Answering.fail_starts -= 1
            raise WorkerDiedError(1, detail="during start-up")
        _Answering.starts += 1
        self.number = _Answering.starts

    def send(self, call: Call) -> bool:
        for rank in call.expected:
            self.host.deliver(call.seq, rank, True, (self.number, rank))
        return True

    def close(self, graceful: bool) -> None:
        self.closed = graceful

    def die(self, rank: int = 1) -> None:
        self.host.worker_died(WorkerDiedError(rank, signal=9))


class _Executor(Executor):
    transport_cls = _Answering


class _Hooks:
    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    @hookimpl
    def executor_worker_died(self, backend: str, ranks: tuple[int, ...], **_: Any) -> None:
        self.events.append(("died", ranks))

    @hookimpl
    def executor_recovery_started(
        self, backend: str, ranks: tuple[int, ...], error: WorkerDiedError
    ) -> None:
        self.events.append(("started", ranks, type(error).__name__))

    @hookimpl
    def executor_recovered(self, backend: str, ranks: tuple[int, ...], duration_s: float) -> None:
        self.events.append(("recovered", ranks, duration_s >= 0))


@pytest.fixture(autouse=True)
def _reset() -> None:
    _Answering.starts = 0
    _Answering.made = []
    _Answering.hold = None
    _Answering.fail_starts = 0
    _Holding.silent = set()


class _Holding(_Answering):
    """Answers at once, but holds a call to ``"hold"`` (:attr:`held`) for the test to answer;
    its liveness probe says the ranks in ``silent`` do not answer."""

    silent: ClassVar[set[int]] = set()

    def send(self, call: Call) -> bool:
        if call.method == "hold":
            self.held = call
            return True
        return super().send(call)

    def probe(self, ranks: Any, timeout: float) -> set[int]:
        return {rank for rank in ranks if rank in _Holding.silent}

    def kill(self, ranks: Any) -> None:
        pass


class _HoldingExecutor(Executor):
    transport_cls = _Holding


def _make(
    policy: RecoveryPolicy | None = None,
    hooks: _Hooks | None = None,
    cls: type[Executor] = _Executor,
) -> Executor:
    registry = Registry()
    if hooks is not None:
        registry.register_plugin(hooks, "recovery-hooks")
    config = ExecutorConfig(
        worker_cls=_Worker, backend=cls, tensor_parallel_size=2, recovery=policy
    )
    return cls(config, registry=registry)


def _wait_state(executor: Executor, state: ExecutorState, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while executor.state is not state:
        assert time.monotonic() < deadline, f"state {executor.state}, not {state}"
        time.sleep(0.005)


def test_without_a_policy_a_death_fails_the_executor_for_good() -> None:
    with _make() as executor:
        failures: list[ExecutorFailedError] = []
        executor.register_failure_callback(failures.append)
        _Answering.made[-1].die()
        assert executor.state is ExecutorState.FAILED
        assert executor.is_failed
        assert [type(f) for f in failures] == [WorkerDiedError]
        with pytest.raises(WorkerDiedError):
            executor.collective_rpc("anything")
    assert executor.state is ExecutorState.CLOSED


def test_a_death_is_recovered_with_new_workers_and_the_hooks_told() -> None:
    hooks = _Hooks()
    with _make(RecoveryPolicy(backoff_s=0.0), hooks) as executor:
        failures: list[ExecutorFailedError] = []
        executor.register_failure_callback(failures.append)
        assert executor.collective_rpc("x") == [(1, 0), (1, 1)]
        first = _Answering.made[-1]
        first.die(1)
        _wait_state(executor, ExecutorState.RUNNING)
        assert executor.collective_rpc("x") == [(2, 0), (2, 1)]  # the new incarnation's
        assert first.closed is False  # the old one stopped by force
        assert not failures
        assert not executor.is_failed
        assert executor.failure is None
    assert hooks.events == [
        ("died", (1,)),
        ("started", (1,), "WorkerDiedError"),
        ("recovered", (1,), True),
    ]


def test_calls_during_a_recovery_wait_for_it_within_their_timeout() -> None:
    with _make(RecoveryPolicy(backoff_s=0.0)) as executor:
        _Answering.hold = threading.Event()
        _Answering.made[-1].die()
        _wait_state(executor, ExecutorState.RECOVERING)
        start = time.monotonic()
        with pytest.raises(RPCTimeoutError):
            executor.collective_rpc("x", timeout=0.2)
        assert 0.15 < time.monotonic() - start < 2
        result: list[Any] = []
        waiter = threading.Thread(target=lambda: result.append(executor.collective_rpc("x")))
        waiter.start()
        time.sleep(0.1)
        assert not result  # waiting
        _Answering.hold.set()
        waiter.join(5)
        assert result == [[(2, 0), (2, 1)]]


def test_calls_during_a_recovery_fail_at_once_when_the_policy_says_so() -> None:
    with _make(RecoveryPolicy(backoff_s=0.0, wait_calls=False)) as executor:
        _Answering.hold = threading.Event()
        _Answering.made[-1].die(1)
        _wait_state(executor, ExecutorState.RECOVERING)
        with pytest.raises(RecoveringError) as caught:
            executor.collective_rpc("x", timeout=5)
        assert caught.value.ranks == (1,)
        _Answering.hold.set()
        _wait_state(executor, ExecutorState.RUNNING)


def test_failed_attempts_are_retried_with_backoff_within_the_budget() -> None:
    with _make(RecoveryPolicy(max_restarts=3, backoff_s=0.05)) as executor:
        _Answering.fail_starts = 2  # two failed attempts, then one that works
        start = time.monotonic()
        _Answering.made[-1].die()
        _wait_state(executor, ExecutorState.RUNNING)
        assert time.monotonic() - start >= 0.05 + 0.1  # backoff 0.05, then 0.1
        assert executor.collective_rpc("x") == [(2, 0), (2, 1)]


def test_the_budget_used_up_fails_the_executor_once() -> None:
    with _make(RecoveryPolicy(max_restarts=1, backoff_s=0.0)) as executor:
        failures: list[ExecutorFailedError] = []
        executor.register_failure_callback(failures.append)
        _Answering.made[-1].die()
        _wait_state(executor, ExecutorState.RUNNING)
        _Answering.made[-1].die()
        _wait_state(executor, ExecutorState.FAILED)
        assert len(failures) == 1
        assert "the recovery policy allows 1 recoveries within 600 s" in str(failures[0])
        assert executor.failure is failures[0]
        with pytest.raises(ExecutorFailedError):
            executor.collective_rpc("x")
        late: list[ExecutorFailedError] = []
        executor.register_failure_callback(late.append)  # failed already: at once
        assert late == failures


def test_fail_is_never_recovered_and_recover_brings_it_back() -> None:
    with _make(RecoveryPolicy(backoff_s=0.0)) as executor:
        assert executor.fail(ExecutorFailedError("the engine says stop"))
        assert executor.state is ExecutorState.FAILED
        assert len(_Answering.made) == 1
        executor.recover()
        assert executor.state is ExecutorState.RUNNING
        assert executor.collective_rpc("x") == [(2, 0), (2, 1)]


def test_recover_without_a_policy() -> None:
    with _make() as executor:
        _Answering.made[-1].die()
        assert executor.is_failed
        executor.recover()
        assert not executor.is_failed
        assert executor.collective_rpc("x") == [(2, 0), (2, 1)]


def test_a_late_reply_of_the_old_workers_reaches_no_new_call() -> None:
    with _make(RecoveryPolicy(backoff_s=0.0)) as executor:
        old = _Answering.made[-1]
        old.die()
        _wait_state(executor, ExecutorState.RUNNING)
        # The old transport delivers a reply for the next sequence number: its host is gone.
        old.host.deliver(2, 0, True, "stale")
        old.host.deliver(2, 1, True, "stale")
        assert executor.collective_rpc("x") == [(2, 0), (2, 1)]


def test_shutdown_during_a_recovery_ends_it() -> None:
    executor = _make(RecoveryPolicy(backoff_s=0.0))
    _Answering.hold = threading.Event()
    _Answering.made[-1].die()
    _wait_state(executor, ExecutorState.RECOVERING)
    threading.Timer(0.2, _Answering.hold.set).start()
    executor.shutdown()
    assert executor.state is ExecutorState.CLOSED
    assert all(t.closed is not None for t in _Answering.made)  # every incarnation closed


def test_a_dropped_executor_is_collected_after_a_recovery() -> None:
    executor = _make(RecoveryPolicy(backoff_s=0.0))
    _Answering.made[-1].die()
    _wait_state(executor, ExecutorState.RUNNING)
    ref = weakref.ref(executor)
    del executor
    gc.collect()
    assert ref() is None
    assert all(t.closed is False for t in _Answering.made)  # the finalizer stopped each


def test_a_policy_is_validated_and_refused_by_a_backend_that_cannot_recover() -> None:
    with pytest.raises(ConfigError, match=r"recovery\.max_restarts"):
        RecoveryPolicy(max_restarts=-1)
    with pytest.raises(ConfigError, match=r"recovery\.backoff_s"):
        RecoveryPolicy(backoff_s=float("nan"))
    with pytest.raises(ConfigError, match="recovery"):
        ExecutorConfig(worker_cls=_Worker, recovery={"max_restarts": 3})  # type: ignore[arg-type]
    config = ExecutorConfig(worker_cls=_Worker, backend="uni", recovery=RecoveryPolicy())
    from executor_core import create_executor

    with pytest.raises(ConfigError, match="cannot start its workers again"):
        create_executor(config, Registry.from_entry_points(allow=["uniproc"]))


# --- a death is reported once, as a death, before anyone sees it -------------------------------


def _outcome(executor: Executor) -> str:
    """What a call made now gets (the name of the error it raises)."""
    try:
        executor.collective_rpc("x", timeout=5)
    except Exception as exc:  # noqa: BLE001 - the test compares the outcome's name
        return f"{type(exc).__name__}: {exc}"
    return "ok"


@pytest.mark.parametrize(
    "policy", [None, RecoveryPolicy(max_restarts=0)], ids=["no-policy", "used-up"]
)
def test_a_caller_that_sees_the_death_finds_the_callbacks_run_and_the_state_failed(
    policy: RecoveryPolicy | None,
) -> None:
    """Issue 48, items 3 and 4: the failure callbacks have run, and the state is ``failed``,
    before the call in flight raises; a call made at that moment raises the documented error
    (the death without a policy, "used up" with one), and a ``shutdown()`` right after the
    error loses no callback."""
    with _make(policy, cls=_HoldingExecutor) as executor:
        failures: list[ExecutorFailedError] = []
        executor.register_failure_callback(failures.append)
        future = executor.collective_rpc("hold", non_block=True)
        seen: list[tuple[int, ExecutorState, str]] = []
        future.add_done_callback(
            lambda _: seen.append((len(failures), executor.state, _outcome(executor)))
        )
        _Answering.made[-1].die(1)
        assert isinstance(future.exception(5), WorkerDiedError)
        executor.shutdown()
    assert len(seen) == 1
    callbacks_run, state, outcome = seen[0]
    assert callbacks_run == 1, "the failure callbacks run before the caller gets the error"
    assert state is ExecutorState.FAILED
    if policy is None:
        assert outcome.startswith("WorkerDiedError: worker rank 1 died")
    else:
        assert outcome.startswith("ExecutorFailedError")
        assert "used up" in outcome
    assert len(failures) == 1


def test_a_callback_that_shuts_down_leaves_the_calls_their_death() -> None:
    """A failure callback may shut the executor down (it runs before the calls in flight
    fail): those calls still raise the death, not ``ExecutorClosedError``."""
    with _make(cls=_HoldingExecutor) as executor:
        executor.register_failure_callback(lambda _: executor.shutdown())
        future = executor.collective_rpc("hold", non_block=True)
        _Answering.made[-1].die(1)
        assert isinstance(future.exception(5), WorkerDiedError)
        assert executor.state is ExecutorState.CLOSED


def test_recover_at_the_moment_of_a_final_death_is_not_undone() -> None:
    """Issue 48, item 4: ``recover()`` called the moment a caller sees the death that used up
    the policy brings the executor back for good: the failure path does not mark it failed
    afterwards."""
    with _make(RecoveryPolicy(max_restarts=0), cls=_HoldingExecutor) as executor:
        future = executor.collective_rpc("hold", non_block=True)
        recovered = threading.Event()

        def recover_now(_: Any) -> None:  # a caller on another thread, woken by the error
            thread = threading.Thread(target=lambda: (executor.recover(5), recovered.set()))
            thread.start()
            thread.join(5)

        future.add_done_callback(recover_now)
        _Answering.made[-1].die(1)
        assert recovered.is_set()
        time.sleep(0.1)  # whatever the failure path still had to do, it has done
        assert executor.state is ExecutorState.RUNNING
        assert executor.collective_rpc("x") == [(2, 0), (2, 1)]


@pytest.mark.parametrize("non_block", [False, True], ids=["blocking", "non-blocking"])
def test_a_death_wins_over_the_survivors_error_that_came_first(non_block: bool) -> None:
    """Issue 48, item 5: with ``unique_reply_rank``, the reply rank's error (a collective's
    "connection reset" as its peer died) may come before the death is reported; a silent
    rank that does not answer the probe is waited for, and the call raises its death."""
    with _make(cls=_HoldingExecutor) as executor:
        transport = _Answering.made[-1]
        _Holding.silent = {1}
        reset = ConnectionResetError("Connection reset by peer")

        def rank0_fails_then_rank1_is_reported() -> None:
            time.sleep(0.05)
            threading.Timer(0.2, transport.die, args=(1,)).start()
            transport.host.deliver(transport.held.seq, 0, False, reset)

        threading.Thread(target=rank0_fails_then_rank1_is_reported).start()
        start = time.monotonic()
        if non_block:
            future = executor.collective_rpc("hold", non_block=True, unique_reply_rank=0)
            error = future.exception(5)
        else:
            with pytest.raises(ExecutorFailedError) as caught:
                executor.collective_rpc("hold", unique_reply_rank=0)
            error = caught.value
        assert isinstance(error, WorkerDiedError), error
        assert error.ranks == (1,)
        assert time.monotonic() - start < 2


def test_a_survivors_error_stands_when_every_other_rank_answers_the_probe() -> None:
    """The confirmation costs one probe: when every silent rank answers, the error is
    raised at once."""
    with _make(cls=_HoldingExecutor) as executor:
        transport = _Answering.made[-1]
        future = executor.collective_rpc("hold", non_block=True, unique_reply_rank=0)
        start = time.monotonic()
        transport.host.deliver(transport.held.seq, 0, False, ValueError("bad batch"))
        error = future.exception(5)
        assert time.monotonic() - start < 0.5
        assert type(error).__name__ == "WorkerError"
        assert "bad batch" in str(error)
        assert executor.collective_rpc("x") == [(1, 0), (1, 1)]
