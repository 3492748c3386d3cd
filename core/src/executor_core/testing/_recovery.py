"""Recovery: a backend that declares it comes back (``Capabilities.recovery``) does, by the
core's rules; one that declares it cannot refuses a policy."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest

from executor_core import (
    ConfigError,
    Executor,
    ExecutorFailedError,
    ExecutorState,
    RecoveringError,
    RecoveryPolicy,
    RPCTimeoutError,
    WorkerDiedError,
)
from executor_core.backend import Transport

from ._base import ExecutorFactory, KitBase
from ._guard import Footprint, pids_alive, resources, shm_held, wait_until

__all__ = ["RecoveryTests", "gloo_sum"]

#: RSS a run of recoveries may add to the driver (allocator noise, not a leak).
_RSS_SLACK = 32 << 20


def gloo_sum(worker: Any) -> float:
    """Join a fresh gloo group at the worker's rendezvous, all_reduce 1.0, leave it."""
    import torch
    import torch.distributed as dist

    from executor_core.torch import init_distributed

    state = init_distributed(worker.context, timeout_s=60)
    try:
        total = torch.ones(1)
        dist.all_reduce(total)
        return float(total.item())
    finally:
        state.destroy()


def _shape(contexts: list[Any]) -> list[tuple[Any, ...]]:
    return [(c.rank, c.local_rank, c.local_world_size, c.node_id, c.world_size) for c in contexts]


class RecoveryTests(KitBase):
    """What ``Capabilities.recovery`` declares holds: ``"none"`` refuses a recovery policy at
    creation; ``"restart"`` brings the executor back after a worker is killed (by the pid it
    reports, where a rank runs in a worker process of its own on this machine), with the
    same ranks, contexts and environment; ``"replace"`` does so with new processes for the
    dead ranks alone, the survivors keeping their processes and memory (and a group restart
    where replacement is off or fails)."""

    #: Seconds a recovery may take, from a kill to workers ready (a restart of every rank).
    recovery_s: ClassVar[float] = 30.0
    #: Kills in a row in the leak test (each recovered; one more then uses the policy up).
    recovery_kills: ClassVar[int] = 5
    #: False where the backend declares rank replacement but this layout's deaths are
    #: answered by a group restart (say why in the class). None: as the backend declares.
    replaces_ranks: ClassVar[bool | None] = None

    def _recovery(self) -> str:
        spec = self.spec()
        if spec is not None:
            declared = spec.capabilities.recovery
        else:  # an unregistered class: what its transport implements
            transport = getattr(self.backend, "transport_cls", Transport)
            declared = "restart" if transport.replace is Transport.replace else "replace"
        return "restart" if declared == "replace" and self.replaces_ranks is False else declared

    def _replacing(self) -> None:
        if self._recovery() != "replace":
            pytest.skip("the backend does not declare rank replacement")

    def _recovering(
        self,
        fresh_executor: ExecutorFactory,
        worker_kwargs: dict[str, Any] | None = None,
        **policy: Any,
    ) -> Executor:
        if self._recovery() == "none":
            pytest.skip("covered by test_recovery_is_refused_where_not_declared")
        recovery = RecoveryPolicy(**{"backoff_s": 0.1, **policy})
        return fresh_executor(recovery=recovery, worker_kwargs=worker_kwargs or {})

    def _kill(self, executor: Executor, pids: list[int | None] | None = None) -> tuple[int, int]:
        """Kill the highest rank in a worker process of its own and wait until the executor
        has seen the death: ``(rank, pid)``."""
        victim, pid = self.victim(self.worker_processes(executor) if pids is None else pids)
        os.kill(pid, signal.SIGKILL)
        seen = wait_until(lambda: executor.state is not ExecutorState.RUNNING, self.settle_s, 0.001)
        assert seen, (
            f"rule broken: a killed rank's death is seen within {self.settle_s:g} s (rank "
            f"{victim}, pid {pid})"
        )
        return victim, pid

    def _wait_running(self, executor: Executor, what: str) -> float:
        start = time.monotonic()
        while executor.state is not ExecutorState.RUNNING:
            took = time.monotonic() - start
            assert executor.state is not ExecutorState.FAILED, (
                f"rule broken: {what}: the executor failed instead of recovering: "
                f"{executor.failure!r}"
            )
            assert took < self.recovery_s, (
                f"rule broken: {what}: the executor is back within recovery_s="
                f"{self.recovery_s:g} s (state {executor.state} after {took:.1f} s)"
            )
            time.sleep(0.02)
        return time.monotonic() - start

    def test_recovery_is_refused_where_not_declared(
        self, executor_factory: ExecutorFactory
    ) -> None:
        """Rule: a backend whose spec declares ``Capabilities(recovery="none")`` refuses a
        config with a recovery policy, before anything starts, naming the field."""
        if self._recovery() != "none":
            pytest.skip("the backend declares recovery; the tests below check it")
        with pytest.raises(ConfigError, match="recovery"):
            executor_factory(recovery=RecoveryPolicy())

    def test_killed_rank_fails_its_call_and_the_executor_comes_back(
        self, fresh_executor: ExecutorFactory
    ) -> None:
        """Rule: a rank killed mid-call fails that call with ``WorkerDiedError`` naming it;
        the executor is back within ``recovery_s``, with the same ranks, local ranks, node
        ids and environment (new processes, a new rendezvous); no failure callback runs;
        every rank meets at the new rendezvous (a gloo ``all_reduce``, where torch is)."""
        executor = self._recovering(fresh_executor)
        failures: list[ExecutorFailedError] = []
        executor.register_failure_callback(failures.append)
        before: list[Any] = executor.collective_rpc("get_context", timeout=self.recovery_s)
        env_before = executor.collective_rpc("get_env", args=("PATH",), timeout=self.recovery_s)
        before_pids = self.worker_processes(executor)
        # In flight when the kill lands: a group restart stops the survivors in it; the
        # survivors of a rank replacement finish it, well within rejoin_timeout_s.
        busy = 2.0 if self._recovery() == "replace" else self.time_limit_s
        future = executor.collective_rpc("slow", args=(busy,), non_block=True)
        time.sleep(0.2)  # the call reached the workers
        victim, pid = self._kill(executor, before_pids)
        try:
            error = future.exception(timeout=self.settle_s)
        except TimeoutError:
            pytest.fail(
                f"rule broken: a death fails the call in flight; rank {victim} was killed and "
                f"the call still waits after {self.settle_s:g} s"
            )
        assert isinstance(error, WorkerDiedError), f"rule broken: not a death: {error!r}"
        assert victim in error.ranks, (
            f"rule broken: the call in flight fails with WorkerDiedError naming rank {victim}, "
            f"not {error!r}"
        )
        self._wait_running(executor, "after a rank was killed")
        after: list[Any] = executor.collective_rpc("get_context", timeout=self.recovery_s)
        assert _shape(after) == _shape(before), (
            "rule broken: a recovered executor has the same ranks, local ranks and nodes"
        )
        assert after[0].distributed_init_method != before[0].distributed_init_method, (
            "rule broken: a recovery meets at a new torch.distributed rendezvous"
        )
        env = executor.collective_rpc("get_env", args=("PATH",), timeout=self.recovery_s)
        assert env == env_before
        pids = self.worker_processes(executor)
        assert pid not in pids
        if self._recovery() == "replace":
            kept = [r for r, p in enumerate(pids) if r != victim and p != before_pids[r]]
            assert not kept, (
                f"rule broken: a rank replacement keeps the survivors' processes; rank(s) "
                f"{kept} got new ones"
            )
            record = executor.last_recovery
            assert record is not None
            assert record.kind == "replace", (
                f"rule broken: a backend that declares replacement replaced ranks: {record}"
            )
            assert record.restarted == (victim,), (
                f"rule broken: only the dead rank {victim} gets a new process: {record}"
            )
        old = [p for p in before_pids if p and p not in pids]
        alive = pids_alive(old, self.settle_s)
        assert not alive, (
            f"rule broken: a recovery stops every worker it replaces: processes of an earlier "
            f"incarnation still run: {alive}"
        )
        assert executor.collective_rpc("is_ready", timeout=self.recovery_s) == [True] * len(pids)
        assert not failures, (
            f"rule broken: a recovered death is no failure; callbacks got {failures}"
        )
        if importlib.util.find_spec("torch") is not None:
            sums = executor.collective_rpc(gloo_sum, timeout=self.recovery_s)
            assert sums == [float(executor.world_size)] * executor.world_size, (
                f"rule broken: after a recovery every rank meets at the new rendezvous: a gloo "
                f"all_reduce across every rank gave {sums}"
            )

    def test_replaced_ranks_leave_the_survivors_memory_alone(
        self, fresh_executor: ExecutorFactory, tmp_path: Path
    ) -> None:
        """Rule (``"replace"``): the survivors keep what they hold in memory and do not load
        their model again; the new rank starts empty and loads its own; every rank is in
        the new context and the survivors ran ``WorkerBase.rejoin``."""
        self._replacing()
        executor = self._recovering(fresh_executor, {"marker_dir": str(tmp_path)})
        executor.collective_rpc("record", args=("before",), timeout=self.recovery_s)
        loads_before = set(tmp_path.glob("load-*"))
        victim, _ = self._kill(executor)
        self._wait_running(executor, "after a rank was killed")
        recorded = executor.collective_rpc("get_recorded", timeout=self.recovery_s)
        for rank, items in enumerate(recorded):
            want = [] if rank == victim else ["before"]
            assert items == want, (
                f"rule broken: a rank replacement keeps the survivors' memory and starts the "
                f"dead rank afresh: rank {rank} holds {items}, not {want}"
            )
        new = sorted(p.name for p in set(tmp_path.glob("load-*")) - loads_before)
        assert [name.split("-")[1] for name in new] == [str(victim)], (
            f"rule broken: only the new rank loads its model again (survivors' load_model is "
            f"not called): new loads {new}"
        )
        contexts = executor.collective_rpc("get_context", timeout=self.recovery_s)
        assert len({c.distributed_init_method for c in contexts}) == 1, (
            f"rule broken: after a rank replacement every rank is in one new context: "
            f"{[c.distributed_init_method for c in contexts]}"
        )

    def test_calls_during_a_recovery_fail_at_once_when_told_to(
        self, fresh_executor: ExecutorFactory
    ) -> None:
        """Rule: with ``wait_calls=False``, a call made during a recovery raises
        ``RecoveringError`` naming the dead rank, at once. With ``replace_ranks=False`` (on a
        backend that replaces ranks) a death restarts every rank: new processes for all."""
        executor = self._recovering(fresh_executor, wait_calls=False, replace_ranks=False)
        before = self.worker_processes(executor)
        victim, _ = self._kill(executor, before)
        if executor.state is ExecutorState.RECOVERING:
            start = time.monotonic()
            with pytest.raises((RecoveringError, WorkerDiedError)) as caught:
                executor.collective_rpc("get_rank", timeout=self.recovery_s)
            assert time.monotonic() - start < 1.0
            if isinstance(caught.value, RecoveringError):
                assert victim in caught.value.ranks
        self._wait_running(executor, "after a rank was killed")
        if self._recovery() == "replace":
            kept = set(self.worker_processes(executor)) & (set(before) - {None})
            assert not kept, f"rule broken: a group restart starts every rank anew: {kept} stayed"
            record = executor.last_recovery
            assert record is not None
            assert record.kind == "restart", f"rule broken: not a restart: {record}"

    def test_survivors_that_do_not_rejoin_in_time_are_restarted(
        self, fresh_executor: ExecutorFactory
    ) -> None:
        """Rule (``"replace"``): survivors still busy after ``rejoin_timeout_s`` do not hold
        the recovery up, even where the new rank's ``init_device`` waits for them at a gloo
        rendezvous (with torch installed): the replacement is abandoned after the bound,
        every rank is restarted, ``last_recovery.reason`` says why, and it comes back."""
        self._replacing()
        gloo = importlib.util.find_spec("torch") is not None
        executor = self._recovering(fresh_executor, {"gloo": gloo}, rejoin_timeout_s=1.0)
        pids = self.worker_processes(executor)
        busy = min(self.recovery_s, 4 * self.settle_s)
        future = executor.collective_rpc("slow", args=(busy,), non_block=True)
        time.sleep(0.2)  # the survivors are in the call
        self._kill(executor, pids)
        with contextlib.suppress(WorkerDiedError):
            future.result(timeout=self.settle_s)
        took = self._wait_running(executor, "with survivors busy in a long call")
        record = executor.last_recovery
        assert record is not None
        assert record.kind == "restart", (
            f"rule broken: survivors that do not rejoin within rejoin_timeout_s are restarted "
            f"with the rest: {record}"
        )
        assert "rejoin_timeout_s" in record.reason, (
            f"rule broken: the record says why the replacement was abandoned: {record}"
        )
        assert took < busy, (
            f"rule broken: the recovery does not wait for a survivor's long call ({took:.1f} s)"
        )
        ranks = executor.collective_rpc("get_rank", timeout=self.recovery_s)
        assert ranks == list(range(executor.world_size))

    def test_a_second_death_during_the_recovery(
        self, fresh_executor: ExecutorFactory, tmp_path: Path
    ) -> None:
        """Rule: a worker of the restart killed while it loads its model fails that attempt;
        the executor tries again (within the policy) and comes back."""
        # Each load takes a second: the second death lands while the restart loads.
        executor = self._recovering(fresh_executor, {"marker_dir": str(tmp_path), "load_s": 1.0})
        loaded = set(tmp_path.glob("load-*"))
        self._kill(executor)

        def restarted() -> list[Path]:
            return sorted(set(tmp_path.glob("load-*")) - loaded)

        assert wait_until(restarted, self.recovery_s, 0.005), (
            "rule broken: a killed rank's executor starts its workers again"
        )
        second = int(restarted()[0].name.rsplit("-", 1)[1])
        if second != os.getpid():
            # Gone already: it had failed with the others; the recovery goes on either way.
            with contextlib.suppress(ProcessLookupError):
                os.kill(second, signal.SIGKILL)
        self._wait_running(executor, "after a second death during the recovery")
        ranks = executor.collective_rpc("get_rank", timeout=self.recovery_s)
        assert ranks == list(range(executor.world_size))

    def test_callers_on_four_threads_during_a_recovery(
        self, fresh_executor: ExecutorFactory
    ) -> None:
        """Rule: while a rank dies and the executor recovers, callers on four threads get
        their own results or the documented errors (``WorkerDiedError`` for a call in flight
        at the death, ``RPCTimeoutError``), never a hang and never another call's reply."""
        executor = self._recovering(fresh_executor)
        stop = threading.Event()
        wrong: list[str] = []
        outcomes: list[str] = []

        def caller(index: int) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                try:
                    replies = executor.collective_rpc(
                        "echo", args=((index, n),), timeout=self.recovery_s
                    )
                except (WorkerDiedError, RPCTimeoutError) as exc:
                    outcomes.append(type(exc).__name__)
                    continue
                except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                    wrong.append(f"thread {index}: {exc!r}")
                    return
                outcomes.append("ok")
                for rank, (replied_rank, args, _) in enumerate(replies):
                    if replied_rank != rank or args != ((index, n),):
                        wrong.append(f"thread {index} call {n}: rank {rank} answered {args}")

        threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(4)]
        for thread in threads:
            thread.start()
        time.sleep(0.3)
        self._kill(executor)
        self._wait_running(executor, "with callers on four threads")
        time.sleep(0.3)
        stop.set()
        for thread in threads:
            thread.join(self.recovery_s)
        assert not [t for t in threads if t.is_alive()], "rule broken: a caller hangs"
        assert not wrong, f"rule broken: {wrong[:5]}"
        assert "ok" in outcomes

    def test_kills_in_a_row_leave_nothing_behind(self, fresh_executor: ExecutorFactory) -> None:
        """Rule: ``recovery_kills`` deaths in a row, each recovered (``max_restarts`` of
        them), leave no process of an earlier incarnation, and the driver as one executor
        left it: the same number of threads, descriptors, /dev/shm mappings and live objects
        of the SDK's and backends' classes (exact: a leak of one per recovery shows), RSS
        within 32 MiB, and no /dev/shm name an earlier incarnation held. One death more uses
        the policy up: the executor fails, its failure callbacks run once, calls raise
        ``ExecutorFailedError``, and ``shutdown()`` returns promptly."""
        footprint = Footprint.take()
        executor = self._recovering(fresh_executor, max_restarts=self.recovery_kills)
        failures: list[ExecutorFailedError] = []
        executor.register_failure_callback(failures.append)
        self._kill(executor)
        self._wait_running(executor, "after the first kill")
        executor.collective_rpc("get_rank", timeout=self.recovery_s)
        before, killed = resources(), []
        for kill in range(2, self.recovery_kills + 1):
            pids = self.worker_processes(executor)
            footprint.note(p for p in pids if p)
            killed.append(self._kill(executor, pids)[1])
            self._wait_running(executor, f"after kill {kill}")
        executor.collective_rpc("get_rank", timeout=self.recovery_s)
        pids = self.worker_processes(executor)
        alive = [pid for pid in pids_alive(killed, self.settle_s) if pid not in pids]
        assert not alive, f"rule broken: processes of an earlier incarnation still run: {alive}"
        limits = {"fds": 0 if self.check_fds else None, "rss": _RSS_SLACK}
        growth: dict[str, str] = {}

        def settled() -> bool:
            now = resources()
            growth.clear()
            for key, was in before.items():
                slack = limits.get(key, 0)
                if slack is not None and now[key] > was + slack:
                    growth[key] = f"{was} -> {now[key]}"
            return not growth

        wait_until(settled, self.settle_s, 0.1)
        assert not growth, (
            f"rule broken: {self.recovery_kills} recoveries leave the driver as one executor "
            f"left it; grown: {growth}"
        )
        live = shm_held([os.getpid(), *(p for p in pids if p)])
        leaked = sorted(n for n in footprint.held - live if os.path.exists(n))
        assert not leaked, f"rule broken: earlier incarnations left /dev/shm entries: {leaked}"
        assert not failures, f"rule broken: a recovered death is no failure: {failures}"
        self._kill(executor, pids)
        failed = wait_until(lambda: executor.state is ExecutorState.FAILED, self.settle_s)
        assert failed, (
            f"rule broken: a death beyond the policy fails the executor (state {executor.state})"
        )
        time.sleep(0.2)  # a second report would land now
        assert len(failures) == 1, f"rule broken: the failure callbacks run once, not {failures}"
        assert executor.is_failed
        assert executor.failure is failures[0]
        with pytest.raises(ExecutorFailedError):
            executor.collective_rpc("get_rank", timeout=10)
        self.assert_prompt_shutdown(executor, "after the recovery policy was used up")
