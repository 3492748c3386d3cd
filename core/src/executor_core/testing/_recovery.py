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
from typing import Any

import pytest

from .._config import ExecutorState, RecoveryPolicy
from .._errors import (
    ConfigError,
    ExecutorFailedError,
    RecoveringError,
    RPCTimeoutError,
    WorkerDiedError,
)
from ._base import ExecutorFactory
from ._guard import grown, pids_alive, resources
from ._recovering import RecoveringBase, gloo_sum

__all__ = ["RecoveryTests"]


class RecoveryTests(RecoveringBase):
    """What ``Capabilities.recovery`` declares holds: ``"none"`` refuses a recovery policy at
    creation; ``"restart"`` brings the executor back after a worker is killed (by the pid it
    reports; ``workers_are_processes``), with the same ranks, contexts and environment;
    ``"replace"`` does so with new processes for the dead ranks alone, the survivors keeping
    their processes and memory (and a group restart where replacement is off or fails)."""

    # --- the declaration -------------------------------------------------------------------

    def test_recovery_is_refused_where_not_declared(
        self, executor_factory: ExecutorFactory
    ) -> None:
        """Rule: a backend whose spec declares ``Capabilities(recovery="none")`` refuses a
        config with a recovery policy, before anything starts, naming the field."""
        if self._recovery() != "none":
            pytest.skip("the backend declares recovery; the tests below check it")
        with pytest.raises(ConfigError, match="recovery"):
            executor_factory(recovery=RecoveryPolicy())

    # --- a death, and back --------------------------------------------------------------

    def test_killed_rank_fails_its_call_and_the_executor_comes_back(
        self, fresh_executor: ExecutorFactory
    ) -> None:
        """Rule: a rank killed mid-call fails that call with ``WorkerDiedError`` naming it;
        the executor is back within ``recovery_s``, with the same ranks, local ranks, node
        ids and environment (new processes, a new rendezvous); no failure callback runs; the
        hooks report the recovery; every rank meets at the new rendezvous (a gloo
        ``all_reduce`` across every rank gives the world size, where torch is installed)."""
        executor = self._recovering(fresh_executor)
        failures: list[ExecutorFailedError] = []
        executor.register_failure_callback(failures.append)
        before: list[Any] = executor.collective_rpc("get_context", timeout=self.recovery_s)
        env_before = executor.collective_rpc("get_env", args=("PATH",), timeout=self.recovery_s)
        before_pids: list[int] = executor.collective_rpc("get_pid", timeout=self.recovery_s)
        # In flight when the kill lands. A group restart must stop the survivors in it; the
        # survivors of a rank replacement finish it, well within the policy's
        # rejoin_timeout_s.
        busy = 2.0 if self._recovery() == "replace" else self.time_limit_s
        future = executor.collective_rpc("slow", args=(busy,), non_block=True)
        time.sleep(0.2)  # the call reached the workers
        victim, pid = self._kill(executor, pids=before_pids)
        try:
            error = future.exception(timeout=self.settle_s)
        except TimeoutError:
            pytest.fail(
                f"rule broken: a death fails the call in flight; rank {victim} was killed and "
                f"the call still waits after {self.settle_s:g} s"
            )
        assert isinstance(error, WorkerDiedError), (
            f"rule broken: the call in flight fails with WorkerDiedError, not {error!r}"
        )
        assert victim in error.ranks, (
            f"rule broken: the WorkerDiedError names rank {victim}, not {error.ranks}"
        )
        self._wait_running(executor, "after a rank was killed")
        after: list[Any] = executor.collective_rpc("get_context", timeout=self.recovery_s)
        shape = [
            (c.rank, c.local_rank, c.local_world_size, c.node_id, c.world_size) for c in before
        ]
        assert [
            (c.rank, c.local_rank, c.local_world_size, c.node_id, c.world_size) for c in after
        ] == shape, "rule broken: a recovered executor has the same ranks, local ranks and nodes"
        assert after[0].distributed_init_method != before[0].distributed_init_method, (
            "rule broken: a group restart meets at a new torch.distributed rendezvous"
        )
        assert (
            executor.collective_rpc("get_env", args=("PATH",), timeout=self.recovery_s)
            == env_before
        )
        pids = executor.collective_rpc("get_pid", timeout=self.recovery_s)
        assert pid not in pids
        if self._recovery() == "replace":
            kept = [r for r in range(len(pids)) if r != victim and pids[r] != before_pids[r]]
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
        old = [p for p in before_pids if p not in pids and p != os.getpid()]
        alive = pids_alive(old, self.settle_s)
        assert not alive, (
            f"rule broken: a recovery stops every worker it replaces: processes of an earlier "
            f"incarnation still run: {alive}"
        )
        assert executor.collective_rpc("is_ready", timeout=self.recovery_s) == [True] * len(pids)
        assert not failures, (
            f"rule broken: a recovered death is no failure; callbacks got {failures}"
        )
        assert pids_alive([pid], self.settle_s) == []
        # Once its own test, on an executor of its own recovered from the same kill: the
        # recovery is the same, so the recovered executor here is checked instead.
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
        executor = self._recovering(fresh_executor, tmp_path)
        executor.collective_rpc("record", args=("before",), timeout=self.recovery_s)
        loads_before = sorted(p.name for p in tmp_path.glob("load-*"))
        victim, _ = self._kill(executor)
        self._wait_running(executor, "after a rank was killed")
        recorded = executor.collective_rpc("get_recorded", timeout=self.recovery_s)
        for rank, items in enumerate(recorded):
            want = [] if rank == victim else ["before"]
            assert items == want, (
                f"rule broken: a rank replacement keeps the survivors' memory and starts the "
                f"dead rank afresh: rank {rank} holds {items}, not {want}"
            )
        loads = sorted(p.name for p in tmp_path.glob("load-*"))
        new = [name for name in loads if name not in loads_before]
        assert [name.split("-")[1] for name in new] == [str(victim)], (
            f"rule broken: only the new rank loads its model again (survivors' load_model is "
            f"not called): new loads {new}"
        )
        contexts = executor.collective_rpc("get_context", timeout=self.recovery_s)
        assert len({c.distributed_init_method for c in contexts}) == 1, (
            f"rule broken: after a rank replacement every rank is in one new context: "
            f"{[c.distributed_init_method for c in contexts]}"
        )

    def test_a_group_restart_where_replacement_is_off(
        self, fresh_executor: ExecutorFactory
    ) -> None:
        """Rule (``"replace"``): with ``RecoveryPolicy(replace_ranks=False)`` a death restarts
        every rank (new processes for all)."""
        self._replacing()
        executor = self._recovering(fresh_executor, replace_ranks=False)
        before = executor.collective_rpc("get_pid", timeout=self.recovery_s)
        self._kill(executor, pids=before)
        self._wait_running(executor, "after a rank was killed")
        after = executor.collective_rpc("get_pid", timeout=self.recovery_s)
        kept = [pid for pid in after if pid in before and pid != os.getpid()]
        assert not kept, f"rule broken: a group restart starts every rank anew: {kept} stayed"
        record = executor.last_recovery
        assert record is not None
        assert record.kind == "restart", record

    def test_survivors_that_do_not_rejoin_in_time_are_restarted(
        self, fresh_executor: ExecutorFactory
    ) -> None:
        """Rule (``"replace"``): survivors still busy after ``rejoin_timeout_s`` (a call
        that does not end with the dead rank) do not hold the recovery up, even where the
        new rank's ``init_device`` waits for them at a gloo rendezvous (as a real model's
        does; with torch installed): the replacement is abandoned after the bound, every
        rank is restarted, ``last_recovery.reason`` says why, and the executor comes back."""
        self._replacing()
        gloo = importlib.util.find_spec("torch") is not None
        executor = self._recovering(
            fresh_executor, rejoin_timeout_s=1.0, worker_kwargs={"gloo": gloo}
        )
        pids = executor.collective_rpc("get_pid", timeout=self.recovery_s)
        victim = max(r for r, pid in enumerate(pids) if pid != os.getpid())
        busy = min(self.recovery_s, 4 * self.settle_s)
        future = executor.collective_rpc("slow", args=(busy,), non_block=True)
        time.sleep(0.2)  # the survivors are in the call
        self._kill(executor, victim, pids)
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
        assert executor.collective_rpc("get_rank", timeout=self.recovery_s) == list(
            range(executor.world_size)
        )

    def test_a_second_death_during_the_recovery(
        self, fresh_executor: ExecutorFactory, tmp_path: Path
    ) -> None:
        """Rule: a worker of the restart killed while it loads its model fails that attempt;
        the executor tries again (within the policy) and comes back."""
        # Each load takes a second: the second death lands while the restart loads.
        executor = self._recovering(fresh_executor, tmp_path, load_s=1.0)
        loaded = set(tmp_path.glob("load-*"))
        self._kill(executor)
        deadline = time.monotonic() + self.recovery_s
        fresh: set[Path] = set()
        while not fresh and time.monotonic() < deadline:  # a worker of the restart loads
            fresh = set(tmp_path.glob("load-*")) - loaded
            time.sleep(0.005)
        assert fresh, "rule broken: a killed rank's executor starts its workers again"
        second = int(sorted(fresh)[0].name.rsplit("-", 1)[1])
        if second != os.getpid():
            # Gone already: it had failed with the others; the recovery goes on either way.
            with contextlib.suppress(ProcessLookupError):
                os.kill(second, signal.SIGKILL)
        self._wait_running(executor, "after a second death during the recovery")
        assert executor.collective_rpc("get_rank", timeout=self.recovery_s) == list(
            range(executor.world_size)
        )

    def test_an_exhausted_policy_fails_the_executor_once(
        self, fresh_executor: ExecutorFactory
    ) -> None:
        """Rule: with ``max_restarts=1``, the first death is recovered and the second fails
        the executor for good: state failed, the failure callbacks run once, calls raise
        ``ExecutorFailedError``, and ``shutdown()`` returns promptly."""
        executor = self._recovering(fresh_executor, max_restarts=1)
        failures: list[ExecutorFailedError] = []
        executor.register_failure_callback(failures.append)
        self._kill(executor)
        self._wait_running(executor, "after the first death")
        self._kill(executor)
        deadline = time.monotonic() + self.settle_s
        while executor.state is not ExecutorState.FAILED and time.monotonic() < deadline:
            time.sleep(0.02)
        assert executor.state is ExecutorState.FAILED, (
            f"rule broken: a death beyond the policy fails the executor (state {executor.state})"
        )
        time.sleep(0.2)  # a second report would land now
        assert len(failures) == 1, f"rule broken: the failure callbacks run once, not {failures}"
        assert executor.is_failed
        assert executor.failure is failures[0]
        with pytest.raises(ExecutorFailedError):
            executor.collective_rpc("get_rank", timeout=10)
        self.assert_prompt_shutdown(executor, "after the recovery policy was used up")

    def test_calls_during_a_recovery_fail_at_once_when_told_to(
        self, fresh_executor: ExecutorFactory, tmp_path: Path
    ) -> None:
        """Rule: with ``wait_calls=False``, a call made during a recovery raises
        ``RecoveringError`` naming the dead rank, at once."""
        executor = self._recovering(fresh_executor, wait_calls=False)
        victim, _ = self._kill(executor)
        if executor.state is ExecutorState.RECOVERING:
            start = time.monotonic()
            with pytest.raises((RecoveringError, WorkerDiedError)) as caught:
                executor.collective_rpc("get_rank", timeout=self.recovery_s)
            assert time.monotonic() - start < 1.0
            if isinstance(caught.value, RecoveringError):
                assert victim in caught.value.ranks
        self._wait_running(executor, "after a rank was killed")

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
                token = (index, n)
                try:
                    replies = executor.collective_rpc(
                        "echo", args=(token,), timeout=self.recovery_s
                    )
                except (WorkerDiedError, RPCTimeoutError) as exc:
                    outcomes.append(type(exc).__name__)
                    continue
                except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                    wrong.append(f"thread {index}: {exc!r}")
                    return
                outcomes.append("ok")
                for rank, (replied_rank, args, _) in enumerate(replies):
                    if replied_rank != rank or args != (token,):
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
        """Rule: ``recovery_kills`` deaths in a row, each recovered: no process of an earlier
        incarnation left, and the driver's threads, descriptors and /dev/shm entries are
        those of one executor."""
        executor = self._recovering(fresh_executor, max_restarts=self.recovery_kills + 1)
        self._kill(executor)
        self._wait_running(executor, "after the first kill")
        executor.collective_rpc("get_rank", timeout=self.recovery_s)
        before = resources()
        killed: list[int] = []
        for _ in range(self.recovery_kills - 1):
            killed.append(self._kill(executor)[1])
            self._wait_running(executor, f"after kill {len(killed) + 1}")
        executor.collective_rpc("get_rank", timeout=self.recovery_s)
        live = set(executor.collective_rpc("get_pid", timeout=self.recovery_s))
        alive = [pid for pid in pids_alive(killed, self.settle_s) if pid not in live]
        assert not alive, f"rule broken: processes of an earlier incarnation still run: {alive}"
        deadline = time.monotonic() + self.settle_s
        while True:
            growth = grown(before, resources(), check_fds=self.check_fds)
            if not growth or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        assert not growth, (
            f"rule broken: {self.recovery_kills} recoveries leave the driver as one executor "
            f"left it; grown: {growth}"
        )
