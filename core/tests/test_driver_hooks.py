"""Driver-side observer hooks: ``executor_call_started``, ``executor_call_finished``,
``executor_worker_died`` and ``executor_sleep_changed``, called by the core for every backend
with the documented arguments, and not at all while no plugin implements them.

The observer is a fixture plugin (tests/fixture_dist, entry point ``fixture_observer``, found
through the ``fixture_plugins`` fixture): it records the driver-side hooks in
``observer.driver_events``.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import signal
import time
from typing import Any

import pytest

from executor_core import (
    RPCTimeoutError,
    WorkerDiedError,
    WorkerError,
    create_executor,
    hookimpl,
)
from executor_core.backend import Registry
from executor_core.testing import conformance_config

Events = list[tuple[str, dict[str, Any]]]


@pytest.fixture
def events(fixture_plugins: str, monkeypatch: pytest.MonkeyPatch) -> Events:
    """What the observer records in this test (its plugin is found through entry points)."""
    recorded: Events = []
    observer = importlib.import_module("executor_fixture_plugins.observer")
    monkeypatch.setattr(observer, "driver_events", recorded)
    return recorded


def _registry(*plugins: str) -> Registry:
    registry = Registry.from_entry_points(allow=list(plugins))
    assert set(registry.plugins) == set(plugins), registry.broken
    return registry


def _calls(events: Events) -> list[dict[str, Any]]:
    """Each call's started and finished events, paired by call id, in start order."""
    started = {e["call_id"]: e for hook, e in events if hook == "call_started"}
    finished = {e["call_id"]: e for hook, e in events if hook == "call_finished"}
    assert set(started) == set(finished), "every started call finishes exactly once"
    assert len(finished) == sum(1 for hook, _ in events if hook == "call_finished")
    return [{**started[i], **finished[i]} for i in sorted(started)]


def _wait_for(predicate: Any, timeout: float = 5.0) -> None:
    give_up = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < give_up, "timed out"
        time.sleep(0.01)


def test_uni_calls_are_observed_with_the_documented_arguments(events: Events) -> None:
    registry = _registry("uniproc", "fixture_observer")
    with create_executor(conformance_config("uni"), registry) as executor:
        assert executor.collective_rpc("get_rank") == [0]  # the inline path
        with pytest.raises(WorkerError):
            executor.collective_rpc("fail", args=("observed",))
        assert executor.collective_rpc("echo", args=(1,), non_block=True).result(5)[0][1] == (1,)
        assert executor.collective_rpc("get_rank", timeout=5) == [0]  # through the transport
        assert executor.execute_model({"x": 1})["batch"] == {"x": 1}
        with pytest.raises(RPCTimeoutError):
            executor.collective_rpc("slow", args=(0.5,), timeout=0.05)
        timed_out = executor.collective_rpc("slow", args=(0.5,), timeout=0.05, non_block=True)
        with pytest.raises(RPCTimeoutError):
            timed_out.result(5)
    calls = _calls(events)
    assert [(c["method"], c["non_block"]) for c in calls] == [
        ("get_rank", False),
        ("fail", False),
        ("echo", True),
        ("get_rank", False),
        ("execute_model", False),
        ("slow", False),
        ("slow", True),
    ]
    for call in calls:
        assert call["backend"] == "uni"
        assert call["world_size"] == 1
        assert isinstance(call["call_id"], int)
        assert call["duration_s"] >= 0
    errors = [c["error"] for c in calls]
    assert isinstance(errors[1], WorkerError)
    assert errors[1].rank == 0
    assert "observed" in str(errors[1])
    assert isinstance(errors[5], RPCTimeoutError)
    assert isinstance(errors[6], RPCTimeoutError)
    assert [e for i, e in enumerate(errors) if i not in (1, 5, 6)] == [None] * 4
    # Call ids are unique in the process: a second executor never reuses one.
    assert len({c["call_id"] for c in calls}) == len(calls)


def test_call_ids_are_unique_across_executors(events: Events) -> None:
    registry = _registry("uniproc", "fixture_observer")
    with (
        create_executor(conformance_config("uni"), registry) as first,
        create_executor(conformance_config("uni"), registry) as second,
    ):
        first.collective_rpc("get_rank")
        second.collective_rpc("get_rank")
        first.collective_rpc("get_rank")
    ids = [c["call_id"] for c in _calls(events)]
    assert len(ids) == len(set(ids)) == 3


def test_non_block_call_finishes_before_its_future(events: Events) -> None:
    registry = _registry("uniproc", "fixture_observer")
    with create_executor(conformance_config("uni"), registry) as executor:
        seen: list[int] = []
        future = executor.collective_rpc("slow", args=(0.05,), non_block=True)
        future.add_done_callback(
            lambda _: seen.append(sum(1 for hook, _ in events if hook == "call_finished"))
        )
        future.result(5)
        assert seen == [1]


def test_asyncio_calls_are_observed_as_non_blocking(events: Events) -> None:
    registry = _registry("uniproc", "fixture_observer")
    with create_executor(conformance_config("uni"), registry) as executor:

        async def calls() -> None:
            assert await executor.collective_rpc_async("get_rank") == [0]
            assert (await executor.execute_model_async(7))["batch"] == 7

        asyncio.run(calls())
    assert [(c["method"], c["non_block"], c["error"]) for c in _calls(events)] == [
        ("get_rank", True, None),
        ("execute_model", True, None),
    ]


def test_sleep_and_wake_up_are_observed(events: Events) -> None:
    registry = _registry("uniproc", "fixture_observer")
    with create_executor(conformance_config("uni"), registry) as executor:
        executor.sleep()
        executor.sleep()  # already asleep: no change, no hook
        executor.wake_up(["weights"])
        executor.wake_up()
    changes = [e for hook, e in events if hook == "sleep_changed"]
    assert changes == [
        {"backend": "uni", "sleeping": True, "tags": frozenset({"weights", "kv_cache"})},
        {"backend": "uni", "sleeping": True, "tags": frozenset({"kv_cache"})},
        {"backend": "uni", "sleeping": False, "tags": frozenset()},
    ]
    assert [c["method"] for c in _calls(events)] == ["sleep", "wake_up", "wake_up"]


def test_a_reported_death_is_observed_once(events: Events) -> None:
    registry = _registry("uniproc", "fixture_observer")
    with create_executor(conformance_config("uni"), registry) as executor:
        died = WorkerDiedError(0, exitcode=-9, ranks=(0,), node="node-a")
        executor.transport.host.worker_died(died)
        executor.transport.host.worker_died(WorkerDiedError(0))  # later reports are ignored
        with pytest.raises(WorkerDiedError):
            executor.collective_rpc("get_rank")
    deaths = [e for hook, e in events if hook == "worker_died"]
    assert deaths == [{"backend": "uni", "ranks": (0,), "node": "node-a", "error": died}]
    # A call refused because the executor failed is not a call: it never started.
    assert _calls(events) == []


def test_other_failures_are_not_deaths(events: Events) -> None:
    from executor_core import ExecutorFailedError

    registry = _registry("uniproc", "fixture_observer")
    with create_executor(conformance_config("uni"), registry) as executor:
        executor.fail(ExecutorFailedError("gave up"))
    assert [hook for hook, _ in events if hook == "worker_died"] == []


def test_mp_calls_and_a_killed_worker_are_observed(events: Events) -> None:
    pytest.importorskip("executor_plugin_multiproc")
    registry = _registry("multiproc", "fixture_observer")
    config = conformance_config("mp", world_size=2, backend_options={"shutdown_grace_s": 1.0})
    with create_executor(config, registry) as executor:
        pids = executor.collective_rpc("get_pid")
        with pytest.raises(WorkerError) as info:
            executor.collective_rpc("fail", args=("boom",), kwargs={"on_rank": 1})
        assert info.value.rank == 1
        pending = executor.collective_rpc("slow", args=(30.0,), non_block=True)
        time.sleep(0.2)
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(WorkerDiedError):
            pending.result(5)
        _wait_for(lambda: any(hook == "worker_died" for hook, _ in events))
    calls = _calls(events)
    assert [(c["method"], c["world_size"], c["backend"]) for c in calls] == [
        ("get_pid", 2, "mp"),
        ("fail", 2, "mp"),
        ("slow", 2, "mp"),
    ]
    assert calls[0]["error"] is None
    assert isinstance(calls[1]["error"], WorkerError)
    assert isinstance(calls[2]["error"], WorkerDiedError)
    deaths = [e for hook, e in events if hook == "worker_died"]
    assert len(deaths) == 1
    assert deaths[0]["backend"] == "mp"
    assert deaths[0]["ranks"] == (1,)
    assert deaths[0]["error"] is calls[2]["error"]


def test_without_an_implementation_nothing_is_called(monkeypatch: pytest.MonkeyPatch) -> None:
    from executor_core import _hooks

    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("an observer hook ran with no implementation")

    monkeypatch.setattr(_hooks.CallObserver, "started", refuse)
    monkeypatch.setattr(_hooks.CallObserver, "finished", refuse)
    registry = _registry("uniproc")  # no observer plugin
    with create_executor(conformance_config("uni"), registry) as executor:
        assert executor.collective_rpc("get_rank") == [0]
        assert executor.collective_rpc("get_rank", non_block=True).result(5) == [0]
        assert executor.execute_model(1)["batch"] == 1
        executor.sleep()
        executor.wake_up()


class _Counter:
    """Implements only the finished hook, with a subset of its arguments."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, BaseException | None]] = []

    @hookimpl
    def executor_call_finished(self, method: str, error: BaseException | None) -> None:
        self.seen.append((method, error))


def test_plugins_registered_and_removed_at_any_time() -> None:
    registry = _registry("uniproc")
    with create_executor(conformance_config("uni"), registry) as executor:
        executor.collective_rpc("get_rank")
        counter = _Counter()
        registry.register_plugin(counter, "counter")
        executor.collective_rpc("get_rank")
        executor.collective_rpc("echo", non_block=True).result(5)
        registry.plugin_manager.unregister(counter)
        executor.collective_rpc("get_rank")
    assert counter.seen == [("get_rank", None), ("echo", None)]


class _Raising:
    @hookimpl
    def executor_call_started(self, method: str) -> None:
        raise RuntimeError(f"observer broke on {method}")

    @hookimpl
    def executor_call_finished(self, method: str) -> None:
        raise RuntimeError(f"observer broke after {method}")

    @hookimpl
    def executor_sleep_changed(self, sleeping: bool) -> None:
        raise RuntimeError("observer broke on sleep")


def test_a_raising_observer_is_logged_and_never_breaks_a_call(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = _registry("uniproc")
    registry.register_plugin(_Raising(), "raising")
    with (
        caplog.at_level(logging.ERROR, "executor_core"),
        create_executor(conformance_config("uni"), registry) as executor,
    ):
        assert executor.collective_rpc("get_rank") == [0]
        assert executor.collective_rpc("get_rank", non_block=True).result(5) == [0]
        executor.sleep()
        assert executor.is_sleeping
    messages = [r.getMessage() for r in caplog.records]
    assert messages.count("an implementation of executor_call_started raised") == 3
    assert messages.count("an implementation of executor_call_finished raised") == 3
    assert "an implementation of executor_sleep_changed raised" in messages
