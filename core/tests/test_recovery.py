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


def _make(policy: RecoveryPolicy | None = None, hooks: _Hooks | None = None) -> Executor:
    registry = Registry()
    if hooks is not None:
        registry.register_plugin(hooks, "recovery-hooks")
    config = ExecutorConfig(
        worker_cls=_Worker, backend=_Executor, tensor_parallel_size=2, recovery=policy
    )
    return _Executor(config, registry=registry)


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
