"""Single-node behaviour on the shared local Ray instance: placement, the channel, failures."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import attrs
import cloudpickle  # type: ignore[import-untyped]  # no type information
import psutil  # type: ignore[import-untyped]  # psutil ships no type information
import pytest
import ray

from executor_core import (
    ExecutorFailedError,
    ExecutorState,
    RecoveryPolicy,
    WorkerDiedError,
    create_executor,
)
from executor_core.testing import conformance_config
from executor_core.testing._guard import freeze  # the kit's own
from executor_plugin_ray._executor import RayExecutor
from executor_plugin_ray._placement import PlacementTimeoutError

pytestmark = pytest.mark.usefixtures("ray_local")

# The helpers below run inside the Ray workers, which cannot import this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def make(**overrides: Any) -> RayExecutor:
    # Actor output is not forwarded, to keep the test log readable.
    options = {"log_to_driver": False, **overrides.pop("backend_options", {})}
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


def test_calls_on_the_rings_and_idle_workers_use_no_cpu() -> None:
    executor = create_executor(
        conformance_config(
            "ray", world_size=2, pipeline_parallel_size=2, backend_options={"log_to_driver": False}
        )
    )
    assert isinstance(executor, RayExecutor)
    try:
        assert executor.ranks_on_rings == (0, 1)
        assert executor.ranks_on_hub == ()
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
    # The failure callbacks have run when the call in flight fails (issue 48).
    assert failures == [err]
    assert executor.is_failed
    # A dead actor does not answer the liveness probe (Ray resolves its call with the
    # death, which is no answer); the live one does.
    assert executor.transport.probe([0, 1], 2.0) == {1}
    with pytest.raises(WorkerDiedError, match="rank 1"):
        executor.collective_rpc("get_rank")
    with pytest.raises(WorkerDiedError, match="rank 1"):
        executor.execute_model(1)
    executor.shutdown()
    assert failures == [err]
    _assert_gone(executor.placements[0].pid)
    return err


def test_killing_an_actor_during_a_call_fails_it_with_rank_and_node() -> None:
    executor = make()
    try:
        _kill_during(executor, executor.collective_rpc("slow", args=(60.0,), non_block=True))
    finally:
        executor.shutdown()


def test_shutdown_removes_actors_and_placement_group() -> None:
    executor = make()
    executor.execute_model(1)
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


def _channel_fds() -> list[str]:
    """The driver's descriptors of the channel's kinds: shared memory, eventfds."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "eventfd" in target or "/dev/shm" in target:
            found.append(target)
    return sorted(found)


def test_shutdown_releases_the_channel() -> None:
    """The rings' segment and doorbells are the executor's alone (Ray's own connection keeps
    sockets of its own): none is left in the driver after shutdown."""
    before = _channel_fds()
    executor = make()
    try:
        assert len(_channel_fds()) > len(before)  # the segment and its doorbells
        big = b"x" * (40 << 20)  # streamed through several slots
        assert executor.collective_rpc("payload_size", args=(big,)) == [len(big)] * 2
    finally:
        executor.shutdown()
    assert _channel_fds() == before
    assert not [name for name in os.listdir("/dev/shm") if name.startswith("executor-")]


# --- rank replacement ---------------------------------------------------------------------


def _recovered(executor: RayExecutor, within_s: float = 60.0) -> None:
    """Wait until the executor (which had not recovered before) recovered and runs."""
    deadline = time.monotonic() + within_s
    while executor.last_recovery is None or executor.state is not ExecutorState.RUNNING:
        assert executor.state is not ExecutorState.FAILED, executor.failure
        assert time.monotonic() < deadline, f"not back within {within_s:g} s"
        time.sleep(0.02)


def test_a_dead_rank_gets_a_new_actor_in_its_own_bundle() -> None:
    """Rank replacement: the dead rank's new actor runs in the dead one's placement-group
    bundle, on the same node with the same local rank, and reads the driver's rings; the
    placements name its pid; the survivor keeps its actor. (Without a spare: with one, the
    spare takes the rank, below.)"""
    executor = make(recovery=RecoveryPolicy(backoff_s=0.1), backend_options={"spare_workers": 0})
    try:
        before = executor.placements
        os.kill(before[1].pid, signal.SIGKILL)
        _recovered(executor)
        record = executor.last_recovery
        assert record is not None
        assert (record.kind, record.restarted) == ("replace", (1,))
        after = executor.placements
        assert after[0] == before[0]
        assert after[1].pid != before[1].pid
        assert attrs.evolve(after[1], pid=before[1].pid) == before[1]  # bundle, node, rank
        assert executor.ranks_on_rings == (0, 1)
        assert executor.collective_rpc("get_pid", timeout=30) == [p.pid for p in after]
        _assert_gone(before[1].pid)
    finally:
        executor.shutdown()
    _assert_gone(after[1].pid)  # the replacement is killed at shutdown like the others


def _spare_pids(executor: RayExecutor, within_s: float = 60.0) -> list[int]:
    """The pids of the executor's spares, once each has imported the worker's module."""
    spares = executor.transport._spares  # RayTransport's
    if spares is None:
        return []
    waiting = list(spares._waiting)
    ray.get([warm for _, warm in waiting], timeout=within_s)
    return [info.pid for info in ray.get([actor.node_info.remote() for actor, _ in waiting])]


def test_a_dead_rank_is_handed_to_a_warm_spare_and_a_new_spare_follows() -> None:
    """With a recovery policy, one idle actor on the driver's node has imported the worker's
    module; the replacement of a dead rank runs in it (the survivor keeps its actor), a new
    spare follows, and shutdown ends both. No spare without a policy or with 0."""
    executor = make(recovery=RecoveryPolicy(backoff_s=0.0))
    try:
        (spare,) = _spare_pids(executor)
        before = executor.placements
        assert spare not in [p.pid for p in before]
        os.kill(before[1].pid, signal.SIGKILL)
        _recovered(executor)
        record = executor.last_recovery
        assert record is not None
        assert (record.kind, record.restarted) == ("replace", (1,))
        pids = executor.collective_rpc("get_pid", timeout=30)
        assert pids == [before[0].pid, spare]
        assert executor.placements[1] == attrs.evolve(before[1], pid=spare)
        assert executor.collective_rpc(lambda w: os.environ["OMP_NUM_THREADS"]) == ["1", "1"]
        (second,) = _spare_pids(executor)
        assert second not in (spare, before[0].pid)
        _assert_gone(before[1].pid)
    finally:
        executor.shutdown()
    _assert_gone(spare)
    _assert_gone(second)
    for options in ({}, {"spare_workers": 0}):
        recovery = RecoveryPolicy() if options else None
        executor = make(recovery=recovery, backend_options=options)
        try:
            assert _spare_pids(executor) == []
        finally:
            executor.shutdown()


def test_a_rank_killed_as_hung_is_replaced_and_its_old_actor_stays_quiet() -> None:
    """A rank declared hung is killed through Ray, whose report of that death comes late:
    it must not fail the replacement (nor the executor afterwards)."""
    executor = make(recovery=RecoveryPolicy(backoff_s=0.0), hang_timeout_s=1.0)
    try:
        pids = executor.collective_rpc("get_pid", timeout=30)
        freeze(pids[1])  # stopped before the call: a spinning worker could answer it
        with pytest.raises(WorkerDiedError, match="rank 1"):
            executor.collective_rpc("echo", args=("frozen",), timeout=30)
        _recovered(executor)
        record = executor.last_recovery
        assert record is not None
        assert record.kind == "replace", record
        time.sleep(2.0)  # the killed actor's watch has failed by now
        assert executor.state is ExecutorState.RUNNING, executor.failure
        after = executor.collective_rpc("get_pid", timeout=30)
        assert after[0] == pids[0]
        assert after[1] != pids[1]
        _assert_gone(pids[1])
    finally:
        executor.shutdown()
