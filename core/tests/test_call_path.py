"""One path for every call: observed or not, ``collective_rpc`` reaches the workers through
``Executor._call``; replies come back through ``TransportHost.deliver``; ``Call`` is built
with keywords only."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import pytest

from executor_core import (
    Executor,
    ExecutorConfig,
    RPCTimeoutError,
    WorkerBase,
    WorkerError,
    create_executor,
    hookimpl,
)
from executor_core.backend import Call, Registry, RemoteFailure, Transport, TransportHost
from executor_core.testing import conformance_config


class _Recorder:
    """A driver-side observer: every call's method, non_block flag and error, in order."""

    def __init__(self) -> None:
        self.started: list[tuple[str, bool]] = []
        self.finished: list[tuple[str, BaseException | None]] = []

    @hookimpl
    def executor_call_started(self, method: str, non_block: bool) -> None:
        self.started.append((method, non_block))

    @hookimpl
    def executor_call_finished(self, method: str, error: BaseException | None) -> None:
        self.finished.append((method, error))


def _script(executor: Executor) -> list[Any]:
    """The same calls on any executor: every way a call can go, and their outcomes."""
    outcomes: list[Any] = []

    def attempt(fn: Any) -> None:
        try:
            outcomes.append(fn())
        except Exception as exc:  # noqa: BLE001 - the outcome is compared, not raised
            outcomes.append(type(exc))

    attempt(lambda: executor.collective_rpc("get_rank"))  # inline
    attempt(lambda: executor.collective_rpc("get_rank", timeout=5))  # through the transport
    attempt(lambda: executor.collective_rpc("echo", args=(1,), non_block=True).result(5)[0][1])
    attempt(lambda: executor.collective_rpc("fail", args=("boom",)))
    attempt(lambda: executor.collective_rpc("slow", args=(0.5,), timeout=0.05))
    attempt(lambda: executor.execute_model({"x": 1})["batch"])
    # Refused before it is a call: not observed, never on the path.
    attempt(lambda: executor.collective_rpc(42))  # type: ignore[call-overload]  # a bad method
    return outcomes


def test_observed_and_plain_calls_take_the_one_path(monkeypatch: pytest.MonkeyPatch) -> None:
    paths: list[str] = []
    one_path = Executor._call

    def spy(self: Executor, *args: Any) -> Any:
        paths.append(self.backend_name)
        return one_path(self, *args)

    monkeypatch.setattr(Executor, "_call", spy)
    recorder = _Recorder()
    observed_registry = Registry.from_entry_points(allow=["uniproc"])
    observed_registry.register_plugin(recorder, "recorder")
    config = conformance_config("uni")
    with create_executor(config, Registry.from_entry_points(allow=["uniproc"])) as plain:
        plain_outcomes = _script(plain)
    plain_paths, paths[:] = list(paths), []
    with create_executor(config, observed_registry) as observed:
        observed_outcomes = _script(observed)

    expected = [[0], [0], (1,), WorkerError, RPCTimeoutError, {"x": 1}, TypeError]
    assert plain_outcomes == observed_outcomes == expected
    # Every call that reached the workers went through _call once, observed or not.
    assert len(plain_paths) == len(paths) == 6
    # The observer saw exactly those calls, each started and finished once, in order.
    methods = ["get_rank", "get_rank", "echo", "fail", "slow", "execute_model"]
    assert recorder.started == [(m, m == "echo") for m in methods]
    assert [m for m, _ in recorder.finished] == methods
    errors = [type(e) if e is not None else None for _, e in recorder.finished]
    assert errors == [None, None, None, WorkerError, RPCTimeoutError, None]


class _Worker(WorkerBase):
    pass


class _HandTransport(Transport):
    """Sends nothing anywhere: the test answers each call through ``host.deliver``."""

    def __init__(self, host: TransportHost) -> None:
        super().__init__(host)
        self.sent: list[Call] = []
        self.ready = threading.Event()

    def start(self) -> None:
        pass

    def send(self, call: Call) -> bool:
        self.sent.append(call)
        self.ready.set()
        return True

    def close(self, graceful: bool) -> None:
        pass


class _HandExecutor(Executor):
    transport_cls = _HandTransport


def test_host_deliver_runs_as_documented() -> None:
    # No method of the host's is shadowed: ``deliver`` is the documented attribute.
    assert "deliver" not in vars(TransportHost)
    config = ExecutorConfig(worker_cls=_Worker, backend=_HandExecutor, tensor_parallel_size=3)
    with create_executor(config) as executor:
        transport = executor.transport
        assert isinstance(transport, _HandTransport)
        deliver = transport.host.deliver
        future: Future[list[Any]] = executor.collective_rpc("m", non_block=True)
        call = transport.sent[-1]
        # From any thread, in any order: the results come back in rank order.
        for rank, value in ((2, "two"), (0, "zero")):
            thread = threading.Thread(target=deliver, args=(call.seq, rank, True, value))
            thread.start()
            thread.join(5)
        assert not future.done()
        deliver(call.seq, 1, True, "one")
        assert future.result(5) == ["zero", "one", "two"]
        # A failure is a RemoteFailure or an exception; the lowest failing rank's wins.
        failing = executor.collective_rpc("m", non_block=True)
        seq = transport.sent[-1].seq
        deliver(seq, 2, False, ValueError("rank two"))
        deliver(seq, 1, False, RemoteFailure.capture(1, "m", KeyError("rank one")))
        deliver(seq, 0, True, None)
        with pytest.raises(WorkerError) as info:
            failing.result(5)
        assert info.value.rank == 1
        # A reply to a call that is no longer in flight is dropped.
        with pytest.raises(RPCTimeoutError):
            executor.collective_rpc("m", timeout=0.05)
        deliver(transport.sent[-1].seq, 0, True, "late")
        deliver(seq, 0, True, "late")
        later = executor.collective_rpc("m", non_block=True)
        for rank in range(3):
            deliver(transport.sent[-1].seq, rank, True, rank)
        assert later.result(5) == [0, 1, 2]


def test_call_is_built_with_keywords_only() -> None:
    with pytest.raises(TypeError):
        Call(1, "m", "m", (), None, None, (0,), None, None)  # type: ignore[call-arg]  # positional on purpose
    call = Call(seq=7, method="m", name="m", expected=(0, 1))
    assert (call.args, call.kwargs, call.reply_rank, call.timeout, call.deadline) == (
        (),
        None,
        None,
        None,
        None,
    )
    assert call.missing() == [0, 1]
    timed = Call(seq=8, method="m", name="m", expected=(0,), timeout=5.0)
    assert timed.deadline is not None
    timed.finish(True, ["ok"])
    timed.finish(False, ValueError("too late"))  # the first outcome wins
    assert timed.outcome() == ["ok"]
