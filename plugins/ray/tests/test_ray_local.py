"""Single-node behaviour on the shared local Ray instance: placement, compiled graph, failures."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import cloudpickle  # type: ignore[import-untyped]  # no type information
import psutil  # type: ignore[import-untyped]  # psutil ships no type information
import pytest
import ray

from executor_core import (
    ExecutorFailedError,
    RPCTimeoutError,
    WorkerDiedError,
    WorkerError,
    create_executor,
)
from executor_core.testing import conformance_config
from executor_plugin_ray._compiled import max_inflight_steps
from executor_plugin_ray._executor import RayExecutor
from executor_plugin_ray._placement import PlacementTimeoutError

pytestmark = pytest.mark.usefixtures("ray_local")

# The helpers below run inside the Ray workers, which cannot import this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def make(**overrides: Any) -> RayExecutor:
    # Actor output is not forwarded, to keep the test log readable. The compiled graph is
    # on unless a test turns it off: most tests here are about that path.
    options = {
        "log_to_driver": False,
        "compiled_graph": True,
        **overrides.pop("backend_options", {}),
    }
    executor = create_executor(
        conformance_config("ray", world_size=2, backend_options=options, **overrides)
    )
    assert isinstance(executor, RayExecutor)
    return executor


@pytest.fixture(scope="module")
def shared() -> Iterator[RayExecutor]:
    executor = make()
    try:
        yield executor
    finally:
        executor.shutdown()


def _where(worker: Any) -> tuple[str, str, int]:
    import os

    import ray

    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()


def test_workers_know_their_node(shared: RayExecutor) -> None:
    seen = shared.collective_rpc(_where)
    contexts = shared.collective_rpc("get_context")
    for rank, placement in enumerate(shared.placements):
        node_id, ip, pid = seen[rank]
        assert placement.rank == rank
        assert (placement.node_id, placement.node_ip, placement.pid) == (node_id, ip, pid)
        assert contexts[rank].node_id == node_id
        assert contexts[rank].local_rank == rank
        assert contexts[rank].local_world_size == 2
        assert contexts[rank].backend == "ray"
    # One node: the rendezvous stays on the configured (loopback) host.
    assert contexts[0].distributed_init_method.startswith("tcp://127.0.0.1:")


def _record_steps(worker: Any) -> None:
    worker.execute_model = lambda batch: worker.record(batch)


def test_compiled_graph_and_actor_calls_keep_submission_order(shared: RayExecutor) -> None:
    assert shared.uses_compiled_graph
    shared.collective_rpc("clear_recorded")
    shared.collective_rpc(_record_steps)
    try:
        futures = [shared.execute_model(i, non_block=True) for i in range(6)]
        # Submitted while the steps may still run: must see all of them, in order.
        assert shared.collective_rpc("get_recorded") == [list(range(6))] * 2
        assert [f.result(timeout=30) for f in futures] == list(range(1, 7))
        more = shared.collective_rpc("record", args=("rpc",), non_block=True)
        assert shared.execute_model("step") == 8
        assert more.result(timeout=30) == [7, 7]
    finally:
        shared.collective_rpc(lambda w: w.__dict__.pop("execute_model", None))


def _fail_steps_on_last_rank(worker: Any) -> None:
    def execute_model(batch: Any) -> Any:
        if worker.rank == worker.world_size - 1:
            raise KeyError(f"bad batch {batch!r}")
        return batch

    worker.execute_model = execute_model


def test_compiled_graph_worker_error_keeps_executor_usable(shared: RayExecutor) -> None:
    shared.collective_rpc(_fail_steps_on_last_rank)
    try:
        with pytest.raises(WorkerError) as info:
            shared.execute_model("x")
        assert info.value.rank == 1
        assert info.value.exc_type == "KeyError"
        assert "bad batch" in info.value.remote_traceback
    finally:
        shared.collective_rpc(lambda w: w.__dict__.pop("execute_model", None))
    assert shared.execute_model("y") == {"rank": 0, "batch": "y"}


def _cpu_seconds_over(pids: list[int], wall_s: float) -> float:
    """CPU seconds the processes ``pids`` used (all threads) during ``wall_s`` of waiting."""
    procs = [psutil.Process(pid) for pid in pids]

    def used() -> float:
        return sum(sum(proc.cpu_times()[:2]) for proc in procs)

    before = used()
    time.sleep(wall_s)
    return used() - before


def test_release_compiled_graph_stops_the_polling_loops_until_the_next_step(
    shared: RayExecutor,
) -> None:
    assert shared.execute_model("a") == {"rank": 0, "batch": "a"}
    assert shared.compiled_graph_live
    pids = [placement.pid for placement in shared.placements]
    polling = _cpu_seconds_over(pids, 1.0)
    assert shared.release_compiled_graph() is True
    assert not shared.compiled_graph_live
    assert shared.release_compiled_graph() is False
    idle = _cpu_seconds_over(pids, 1.0)
    # Live, Ray's loops poll on both workers (each takes a large part of a core); released,
    # the workers wait without using the CPU.
    assert polling > 0.3, f"the live graph's loops used {polling:.3f} CPU s in 1 s"
    assert idle < 0.1, f"the released workers used {idle:.3f} CPU s in 1 s"
    assert shared.execute_model("b") == {"rank": 0, "batch": "b"}  # compiles again
    assert shared.compiled_graph_live
    assert shared.collective_rpc("get_rank") == [0, 1]


def test_release_compiled_graph_waits_for_steps_in_flight_and_sleep_releases(
    shared: RayExecutor,
) -> None:
    shared.collective_rpc(_slow_steps)
    try:
        steps = [shared.execute_model(0.3, non_block=True) for _ in range(2)]
        assert shared.release_compiled_graph() is True
        assert [step.result(timeout=0) for step in steps] == [{"slept": 0.3}] * 2
    finally:
        shared.collective_rpc(lambda w: w.__dict__.pop("execute_model", None))
    assert shared.execute_model("c") == {"rank": 0, "batch": "c"}
    shared.sleep()
    assert not shared.compiled_graph_live
    shared.wake_up()
    assert shared.execute_model("d") == {"rank": 0, "batch": "d"}
    assert shared.compiled_graph_live


def _slow_steps(worker: Any) -> None:
    import time

    def execute_model(batch: Any) -> Any:
        time.sleep(batch)
        return {"slept": batch}

    worker.execute_model = execute_model


def test_compiled_graph_timeout_names_the_output_rank_and_recovers() -> None:
    executor = make(rpc_timeout=0.5)
    try:
        executor.collective_rpc(_slow_steps)
        assert executor.execute_model(0) == {"slept": 0}
        start = time.monotonic()
        with pytest.raises(RPCTimeoutError) as info:
            executor.execute_model(2.0)
        assert time.monotonic() - start < 1.9
        assert info.value.method == "execute_model"
        # The core names the ranks whose answer was awaited: execute_model's is the output
        # rank's alone.
        assert list(info.value.ranks) == [executor.output_rank]
        time.sleep(1.6)  # let the late step finish; its result is dropped
        assert executor.execute_model(0.01) == {"slept": 0.01}
    finally:
        executor.shutdown()


def test_more_steps_in_flight_than_the_graph_holds_wait_for_a_slot() -> None:
    executor = make()  # no rpc_timeout: a step waits for a free slot as long as it takes
    try:
        executor.collective_rpc(_slow_steps)
        steps = max_inflight_steps() + 8
        futures = [executor.execute_model(0.01, non_block=True) for _ in range(steps)]
        assert [f.result(timeout=60) for f in futures] == [{"slept": 0.01}] * steps
    finally:
        executor.shutdown()


def test_actor_path_by_default_and_idle_workers_use_no_cpu() -> None:
    # The defaults, but for the log: execute_model as actor calls, so that nothing spins.
    executor = create_executor(
        conformance_config(
            "ray", world_size=2, pipeline_parallel_size=2, backend_options={"log_to_driver": False}
        )
    )
    assert isinstance(executor, RayExecutor)
    try:
        assert not executor.uses_compiled_graph
        assert executor.execute_model([7]) == {"rank": 1, "batch": [7]}
        futures = [executor.execute_model(i, non_block=True) for i in range(3)]
        assert [f.result(timeout=30)["batch"] for f in futures] == [0, 1, 2]
        workers = [psutil.Process(p.pid) for p in executor.placements]
        before = [w.cpu_times() for w in workers]
        driver_before = time.process_time()
        time.sleep(1.0)
        for worker, start in zip(workers, before, strict=True):
            used = sum(worker.cpu_times()[:2]) - sum(start[:2])
            assert used < 0.1, f"an idle worker used {used:.2f} s of CPU in 1 s"
        assert time.process_time() - driver_before < 0.1
    finally:
        executor.shutdown()


def test_placement_timeout_explains_what_is_missing() -> None:
    start = time.monotonic()
    with pytest.raises(PlacementTimeoutError) as info:
        make(backend_options={"num_cpus_per_worker": 64, "placement_timeout": 1.0})
    assert time.monotonic() - start < 10
    text = str(info.value)
    assert "placement_timeout=1 s" in text
    assert "2 bundle(s) of {CPU: 64}" in text
    assert "total {CPU: 128}" in text
    assert "Cluster total: {CPU: 8" in text
    assert "Available now:" in text
    _assert_no_pending_groups()


def test_missing_custom_resource_times_out_clearly() -> None:
    with pytest.raises(PlacementTimeoutError, match="accel_x: 1"):
        make(backend_options={"resources_per_worker": {"accel_x": 1}, "placement_timeout": 0.5})
    _assert_no_pending_groups()


def _assert_no_pending_groups() -> None:
    table = ray.util.placement_group_table()  # type: ignore[no-untyped-call]  # unannotated
    assert all(group["state"] in ("REMOVED", "CREATED") for group in table.values())


def test_strict_pack_and_custom_cpus() -> None:
    executor = make(
        backend_options={"placement_strategy": "STRICT_PACK", "num_cpus_per_worker": 0.5}
    )
    try:
        assert len({p.node_id for p in executor.placements}) == 1
        assert executor.options.placement_strategy == "STRICT_PACK"
        assert executor.collective_rpc("get_rank") == [0, 1]
    finally:
        executor.shutdown()


def _kill_during(executor: RayExecutor, pending: Future[Any]) -> WorkerDiedError:
    """SIGKILL rank 1's actor while ``pending`` runs; return the error the call fails with."""
    failures: list[ExecutorFailedError] = []
    executor.register_failure_callback(failures.append)
    victim = executor.placements[1]
    time.sleep(0.3)
    killed_at = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    with pytest.raises(WorkerDiedError) as info:
        pending.result(timeout=15)
    assert time.monotonic() - killed_at < 5
    err = info.value
    assert err.rank == 1
    assert victim.node_id in str(err)
    assert str(victim.pid) in str(err)
    # The core fails the calls in flight first, then runs the failure callbacks.
    deadline = time.monotonic() + 5
    while not failures and time.monotonic() < deadline:
        time.sleep(0.01)
    assert failures == [err]
    assert executor.is_failed
    with pytest.raises(WorkerDiedError, match="rank 1"):
        executor.collective_rpc("get_rank")
    with pytest.raises(WorkerDiedError, match="rank 1"):
        executor.execute_model(1)
    executor.shutdown()
    assert failures == [err]
    _assert_gone(executor.placements[0].pid)
    return err


@pytest.mark.parametrize("direct_calls", [True, False], ids=["direct", "actor-calls"])
def test_killing_an_actor_during_a_call_fails_it_with_rank_and_node(direct_calls: bool) -> None:
    executor = make(backend_options={"compiled_graph": False, "direct_calls": direct_calls})
    assert executor.uses_direct_calls == direct_calls
    try:
        _kill_during(executor, executor.collective_rpc("slow", args=(60.0,), non_block=True))
    finally:
        executor.shutdown()


def test_killing_an_actor_during_a_compiled_step() -> None:
    executor = make()
    try:
        executor.collective_rpc(_slow_steps)
        assert executor.execute_model(0) == {"slept": 0}
        _kill_during(executor, executor.execute_model(60.0, non_block=True))
    finally:
        executor.shutdown()


def test_shutdown_removes_actors_and_placement_group() -> None:
    executor = make()
    executor.execute_model(1)  # build the compiled graph, so that teardown is exercised
    pids = [p.pid for p in executor.placements]
    groups_before = _live_groups()
    executor.shutdown()
    for pid in pids:
        _assert_gone(pid)
    assert len(_live_groups()) == len(groups_before) - 1


def _live_groups() -> list[str]:
    table = ray.util.placement_group_table()  # type: ignore[no-untyped-call]  # unannotated
    return [gid for gid, group in table.items() if group["state"] != "REMOVED"]


def _assert_gone(pid: int, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.1)
    raise AssertionError(f"Ray worker process {pid} still runs {within} s after shutdown")
