"""Deaths and hangs: recovery after a worker is killed (``Capabilities.recovery``), and a frozen
rank declared dead within ``hang_timeout_s`` (``Capabilities.liveness_probe``)."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
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

from ._base import ExecutorFactory, KitBase, check_reply_ranks, in_threads
from ._guard import Footprint, freeze, pids_alive, resources, shm_held, wait_until

#: RSS a run of recoveries may add to the driver (allocator noise, not a leak).
_RSS_SLACK = 32 << 20


def gloo_sum(worker: Any, keep: bool = False) -> float:
    """Sum 1.0 over the ranks in a new gloo group (kept, with ``keep``) or the kept one."""
    import torch
    import torch.distributed as dist

    from executor_core.torch import init_distributed

    group = worker.__dict__.get("_kit_group") or init_distributed(worker.context, timeout_s=60)
    worker.__dict__["_kit_group"] = group if keep else worker.__dict__.get("_kit_group")
    try:
        total = torch.ones(1)
        dist.all_reduce(total)
        return float(total.item())
    finally:
        if group is not worker.__dict__["_kit_group"]:
            group.destroy()


class RecoveryTests(KitBase):
    """``"none"`` refuses a policy; ``"restart"`` brings the executor back after a worker is
    killed; ``"replace"`` with new processes for the dead ranks alone."""

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

    def _recovering(
        self,
        fresh_executor: ExecutorFactory,
        worker_kwargs: dict[str, Any] | None = None,
        replacing: bool = False,
        **policy: Any,
    ) -> Executor:
        if self._recovery() == "none":
            pytest.skip("covered by test_recovery_is_refused_where_not_declared")
        if replacing and self._recovery() != "replace":
            pytest.skip("the backend does not declare rank replacement")
        recovery = RecoveryPolicy(**{"backoff_s": 0.1, **policy})
        return fresh_executor(recovery=recovery, worker_kwargs=worker_kwargs or {})

    def _kill(self, executor: Executor, pids: list[int | None] | None = None) -> tuple[int, int]:
        """Kill a worker, wait until the executor has seen the death: ``(rank, pid)``."""
        victim, pid = self.victim(self.worker_processes(executor) if pids is None else pids)
        os.kill(pid, signal.SIGKILL)
        seen = wait_until(lambda: executor.state is not ExecutorState.RUNNING, self.settle_s, 0.001)
        assert seen, f"rule broken: a killed rank's death is seen within {self.settle_s:g} s"
        return victim, pid

    def test_recovery_is_refused_where_not_declared(
        self, executor_factory: ExecutorFactory
    ) -> None:
        """Rule: ``Capabilities(recovery="none")`` refuses a recovery policy, naming it."""
        if self._recovery() != "none":
            pytest.skip("the backend declares recovery; the tests below check it")
        with pytest.raises(ConfigError, match="recovery"):
            executor_factory(recovery=RecoveryPolicy())

    def test_killed_rank_fails_its_call_and_the_executor_comes_back(
        self, fresh_executor: ExecutorFactory
    ) -> None:
        """Rule: a rank killed mid-call fails it with ``WorkerDiedError``; within ``recovery_s``
        the executor is back with the same ranks, nodes and env, new processes (the dead
        rank's alone, where it replaces) and a new rendezvous where all meet; no callback."""
        executor = self._recovering(fresh_executor)
        failures: list[ExecutorFailedError] = []
        executor.register_failure_callback(failures.append)
        before = executor.collective_rpc("get_context", timeout=self.recovery_s)
        env_before = executor.collective_rpc("get_env", args=("PATH",), timeout=self.recovery_s)
        before_pids = self.worker_processes(executor)
        # In flight at the kill: a replacement's survivors finish it within rejoin_timeout_s.
        busy = 2.0 if self._recovery() == "replace" else self.time_limit_s
        future = executor.collective_rpc("slow", args=(busy,), non_block=True)
        time.sleep(0.2)  # the call reached the workers
        victim, pid = self._kill(executor, before_pids)
        self.died(future, victim, "a death fails the call in flight")
        self.wait_running(executor, "after a rank was killed", self.recovery_s)
        after = executor.collective_rpc("get_context", timeout=self.recovery_s)
        places = [(c.rank, c.local_rank, c.local_world_size, c.node_id) for c in before]
        assert places == [(c.rank, c.local_rank, c.local_world_size, c.node_id) for c in after], (
            "rule broken: a recovered executor has the same ranks, local ranks and nodes"
        )
        assert after[0].distributed_init_method != before[0].distributed_init_method, (
            "rule broken: a recovery meets at a new torch.distributed rendezvous"
        )
        assert executor.collective_rpc("get_env", 30, ("PATH",)) == env_before
        pids = self.worker_processes(executor)
        assert pid not in pids
        if self._recovery() == "replace":
            kept = [r for r, p in enumerate(pids) if r != victim and p != before_pids[r]]
            assert not kept, f"rule broken: a rank replacement keeps the survivors' pids: {kept}"
            record = executor.last_recovery
            assert record is not None
            assert (record.kind, record.restarted) == ("replace", (victim,)), (
                f"rule broken: a backend that declares replacement replaces the dead rank "
                f"{victim} alone: {record}"
            )
        alive = pids_alive([p for p in before_pids if p and p not in pids], self.settle_s)
        assert not alive, f"rule broken: processes of an earlier incarnation still run: {alive}"
        assert executor.collective_rpc("is_ready", timeout=30) == [True] * len(pids)
        assert not failures, f"rule broken: a recovered death is no failure: {failures}"
        if importlib.util.find_spec("torch") is not None:
            sums = executor.collective_rpc(gloo_sum, timeout=self.recovery_s)
            assert sums == [float(len(pids))] * len(pids), (
                f"rule broken: after a recovery every rank meets at the new rendezvous: a gloo "
                f"all_reduce gave {sums}"
            )

    def test_replaced_ranks_leave_the_survivors_memory_alone(
        self, fresh_executor: ExecutorFactory, tmp_path: Path
    ) -> None:
        """Rule (``"replace"``): the survivors keep their memory and do not load again; the
        new rank starts empty; every rank is in the new context (``WorkerBase.rejoin``)."""
        executor = self._recovering(fresh_executor, {"marker_dir": str(tmp_path)}, True)
        executor.collective_rpc("record", args=("before",), timeout=self.recovery_s)
        loads_before = set(tmp_path.glob("load-*"))
        victim, _ = self._kill(executor)
        self.wait_running(executor, "after a rank was killed", self.recovery_s)
        recorded = executor.collective_rpc("get_recorded", timeout=self.recovery_s)
        want = [[] if rank == victim else ["before"] for rank in range(len(recorded))]
        assert recorded == want, (
            f"rule broken: a rank replacement keeps the survivors' memory and starts the dead "
            f"rank afresh: {recorded}, not {want}"
        )
        new = sorted(p.name for p in set(tmp_path.glob("load-*")) - loads_before)
        assert [name.split("-")[1] for name in new] == [str(victim)], (
            f"rule broken: only the new rank loads its model again: new loads {new}"
        )
        contexts = executor.collective_rpc("get_context", timeout=self.recovery_s)
        methods = {c.distributed_init_method for c in contexts}
        assert len(methods) == 1, f"rule broken: every rank is in one new context: {methods}"

    def test_calls_during_a_recovery_fail_at_once_when_told_to(
        self, fresh_executor: ExecutorFactory
    ) -> None:
        """Rule: with ``wait_calls=False`` a call during a recovery raises ``RecoveringError``
        at once; with ``replace_ranks=False`` a death restarts every rank."""
        executor = self._recovering(fresh_executor, wait_calls=False, replace_ranks=False)
        before = self.worker_processes(executor)
        victim, _ = self._kill(executor, before)
        if executor.state is ExecutorState.RECOVERING:
            start = time.monotonic()
            with pytest.raises((RecoveringError, WorkerDiedError)) as caught:
                executor.collective_rpc("get_rank", timeout=self.recovery_s)
            assert time.monotonic() - start < 1.0
            assert victim in getattr(caught.value, "ranks", [victim])
        self.wait_running(executor, "after a rank was killed", self.recovery_s)
        if self._recovery() == "replace":
            kept = set(self.worker_processes(executor)) & (set(before) - {None})
            assert not kept, f"rule broken: a group restart starts every rank anew: {kept} stayed"
            assert getattr(executor.last_recovery, "kind", None) == "restart"

    def test_survivors_that_do_not_rejoin_in_time_are_restarted(
        self, fresh_executor: ExecutorFactory
    ) -> None:
        """Rule (``"replace"``): survivors busy past ``rejoin_timeout_s`` (while the new rank
        waits for them at a gloo rendezvous) make a group restart, its reason recorded."""
        gloo = importlib.util.find_spec("torch") is not None
        executor = self._recovering(fresh_executor, {"gloo": gloo}, True, rejoin_timeout_s=1.0)
        busy, pids = min(self.recovery_s, 4 * self.settle_s), self.worker_processes(executor)
        future = executor.collective_rpc("slow", args=(busy,), non_block=True)
        time.sleep(0.2)  # the survivors are in the call
        self._kill(executor, pids)
        with contextlib.suppress(WorkerDiedError):
            future.result(timeout=self.settle_s)
        took = self.wait_running(executor, "with survivors busy in a long call", self.recovery_s)
        record = executor.last_recovery
        assert record is not None
        assert record.kind == "restart", (
            f"rule broken: survivors that do not rejoin within rejoin_timeout_s are restarted "
            f"with the rest: {record}"
        )
        assert "rejoin_timeout_s" in record.reason, f"rule broken: the record says why: {record}"
        assert took < busy, f"rule broken: the recovery waited for a survivor ({took:.1f} s)"
        check_reply_ranks(executor, self.recovery_s)

    def test_a_second_death_during_the_recovery(
        self, fresh_executor: ExecutorFactory, tmp_path: Path
    ) -> None:
        """Rule: a worker of the restart killed while it loads its model (half a second)
        fails that attempt; the executor tries again, within the policy, and comes back."""
        executor = self._recovering(fresh_executor, {"marker_dir": str(tmp_path), "load_s": 0.5})
        loaded = set(tmp_path.glob("load-*"))
        self._kill(executor)

        def restarted() -> list[Path]:
            return sorted(set(tmp_path.glob("load-*")) - loaded)

        assert wait_until(restarted, self.recovery_s, 0.005), (
            "rule broken: a killed rank's executor starts its workers again"
        )
        second = int(restarted()[0].name.rsplit("-", 1)[1])
        if second != os.getpid():  # gone already (it failed with the others): fine too
            with contextlib.suppress(ProcessLookupError):
                os.kill(second, signal.SIGKILL)
        self.wait_running(executor, "after a second death during the recovery", self.recovery_s)
        check_reply_ranks(executor, self.recovery_s)

    def test_callers_on_four_threads_during_a_recovery(
        self, fresh_executor: ExecutorFactory
    ) -> None:
        """Rule: through a death and recovery, callers on four threads get their own results,
        ``WorkerDiedError`` or ``RPCTimeoutError``; never a hang, never another's reply."""
        executor = self._recovering(fresh_executor)
        stop, wrong, outcomes = threading.Event(), list[str](), list[str]()

        def caller(index: int) -> None:
            for n in itertools.count():
                if stop.is_set():
                    return
                try:
                    replies = executor.collective_rpc("echo", self.recovery_s, ((index, n),))
                except (WorkerDiedError, RPCTimeoutError) as exc:
                    outcomes.append(type(exc).__name__)
                    continue
                outcomes.append("ok")
                if replies != [(r, ((index, n),), {}) for r in range(len(replies))]:
                    wrong.append(f"thread {index} call {n} got {replies}")

        def kill_and_stop(index: int) -> None:
            if index < 4:
                return caller(index)
            try:
                time.sleep(0.3)
                self._kill(executor)
                self.wait_running(executor, "with callers on four threads", self.recovery_s)
                time.sleep(0.3)
            finally:
                stop.set()

        in_threads(5, kill_and_stop)
        assert not wrong, f"rule broken: {wrong[:5]}"
        assert "ok" in outcomes

    def test_kills_in_a_row_leave_nothing_behind(self, fresh_executor: ExecutorFactory) -> None:
        """Rule: ``recovery_kills`` deaths in a row, each recovered, leave no earlier process,
        no /dev/shm name it held, and the driver with as many threads, descriptors, /dev/shm
        mappings and live ``executor_*`` objects (a leak of one per recovery shows) and RSS
        within 32 MiB. One more death uses the policy up: failed, callbacks once, prompt
        ``shutdown()``."""
        footprint = Footprint(self.session_threads, self.check_fds)
        executor = self._recovering(fresh_executor, max_restarts=self.recovery_kills)
        failures: list[ExecutorFailedError] = []
        executor.register_failure_callback(failures.append)
        before: dict[str, int] = {}
        killed: list[int] = []
        for kill in range(1, self.recovery_kills + 1):
            pids = self.worker_processes(executor)
            footprint.note(pids)
            killed.append(self._kill(executor, pids)[1])
            self.wait_running(executor, f"after kill {kill}", self.recovery_s)
            executor.collective_rpc("get_rank", timeout=self.recovery_s)
            before = before or resources()  # as one executor left it: after the first
        pids = self.worker_processes(executor)
        alive = [pid for pid in pids_alive(killed, self.settle_s) if pid not in pids]
        assert not alive, f"rule broken: processes of an earlier incarnation still run: {alive}"
        # Two objects may be of an incarnation whose threads still end (a loaded machine), and
        # one thread a library starts once, late (Ray's): a leak of one per recovery still
        # shows, as one more for each after the first.
        slack = {"rss": _RSS_SLACK, "fds": 0 if self.check_fds else 1 << 30, "objects": 2}
        slack["threads"] = 1

        def grown() -> dict[str, str]:
            now = resources()
            return {
                k: f"{v} -> {now[k]}" for k, v in before.items() if now[k] > v + slack.get(k, 0)
            }

        wait_until(lambda: not grown(), self.settle_s, 0.1)
        assert not (growth := grown()), (
            f"rule broken: {self.recovery_kills} recoveries leave the driver as one executor "
            f"left it; grown: {growth}"
        )
        live = shm_held([os.getpid(), *(p for p in pids if p)])
        leaked = sorted(n for n in footprint.held - live if os.path.exists(n))
        assert not leaked, f"rule broken: earlier incarnations left /dev/shm entries: {leaked}"
        assert not failures, f"rule broken: a recovered death is no failure: {failures}"
        self._kill(executor, pids)
        failed = wait_until(lambda: executor.state is ExecutorState.FAILED, self.settle_s)
        assert failed, "rule broken: a death beyond the policy fails the executor"
        time.sleep(0.2)  # a second report would land now
        assert len(failures) == 1, f"rule broken: the failure callbacks run once, not {failures}"
        assert executor.failure is failures[0]
        with pytest.raises(ExecutorFailedError):
            executor.collective_rpc("get_rank", timeout=10)
        self.assert_prompt_shutdown(executor, "after the recovery policy was used up")


class HangTests(KitBase):
    """With a probe, a stopped worker (SIGSTOP) is declared dead, named, killed and recovered;
    a worker busy in a long call is not. Without one, ``hang_timeout_s`` is refused."""

    #: The bound the kit sets; a frozen rank is declared within ``hang_grace`` times it.
    hang_timeout_s: ClassVar[float] = 1.0
    hang_grace: ClassVar[float] = 3.5

    def _probed(self) -> bool:
        spec = self.spec()
        if spec is not None:
            return spec.capabilities.liveness_probe
        transport = getattr(self.backend, "transport_cls", Transport)  # an unregistered class
        return transport.probe is not Transport.probe

    def _hang_executor(self, fresh_executor: ExecutorFactory, **config: Any) -> Executor:
        if not self._probed():
            pytest.skip("covered by test_hang_bound_is_refused_without_a_probe")
        spec = self.spec()
        if spec is not None and spec.capabilities.recovery != "none":
            config.setdefault("recovery", RecoveryPolicy(backoff_s=0.1))
        return fresh_executor(hang_timeout_s=self.hang_timeout_s, **config)

    def _freeze_during(self, executor: Executor, method: Any) -> None:
        """SIGSTOP a worker, call ``method``: the call fails naming that rank alone (and its
        node) within about the bound, and its process is killed."""
        nodes = [c.node_id for c in executor.collective_rpc("get_context", timeout=30)]
        victim, pid = self.victim(self.worker_processes(executor))
        freeze(pid)
        future = executor.collective_rpc(method, non_block=True)
        bound = self.hang_timeout_s
        rule = f"a frozen rank is declared dead within about the hang bound ({bound:g} s)"
        try:
            error = self.died(future, victim, rule, bound * self.hang_grace + self.settle_s)
        except BaseException:
            os.kill(pid, signal.SIGKILL)
            raise
        assert error.ranks == (victim,), (
            f"rule broken: the error names the frozen rank {victim} alone, not {error.ranks} "
            "(the others answered the probe)"
        )
        assert len(set(nodes)) == 1 or error.node == nodes[victim], (
            f"rule broken: a hung rank on one of several nodes is named with its node "
            f"{nodes[victim]!r} (as a killed one is), not {error.node!r}"
        )
        assert not pids_alive([pid], self.settle_s), (
            f"rule broken: a rank declared hung is killed; pid {pid} still runs"
        )

    def test_hang_bound_is_refused_without_a_probe(self, executor_factory: ExecutorFactory) -> None:
        """Rule: ``Capabilities(liveness_probe=False)`` refuses ``hang_timeout_s``."""
        if self._probed():
            pytest.skip("the backend declares a probe; the tests below check it")
        with pytest.raises(ConfigError, match="hang_timeout_s"):
            executor_factory(hang_timeout_s=self.hang_timeout_s)

    def test_a_frozen_rank_is_declared_dead(self, fresh_executor: ExecutorFactory) -> None:
        """Rule: a call three times the bound in workers that answer the probe completes; a
        frozen rank is declared dead (and recovered, with a policy, else failed once)."""
        executor = self._hang_executor(fresh_executor)
        failures: list[ExecutorFailedError] = []
        executor.register_failure_callback(failures.append)
        seconds = self.hang_timeout_s * 3
        call = executor.collective_rpc("slow", self.time_limit_s, (seconds, "done"), non_block=True)
        replies = call.exception() or call.result()
        assert replies == [(r, "done") for r in range(executor.world_size)], (
            f"rule broken: a long call in workers that answer the probe completes: {replies!r}"
        )
        state = executor.state
        assert state is ExecutorState.RUNNING, f"rule broken: a long call is no hang ({state})"
        self._freeze_during(executor, "echo")
        if executor.config.recovery is None:
            assert executor.state is ExecutorState.FAILED
            assert len(failures) == 1
            return
        self.wait_running(executor, "after a hung rank was declared dead", self.time_limit_s)
        check_reply_ranks(executor, self.time_limit_s)
        assert not failures

    def test_a_collective_waiting_for_a_frozen_peer(self, fresh_executor: ExecutorFactory) -> None:
        """Rule: ranks blocked in a gloo ``all_reduce`` on a frozen peer are not declared."""
        preload = ("torch.distributed", "executor_core.torch")
        if self._probed():
            pytest.importorskip("torch")
        executor = self._hang_executor(fresh_executor, worker_kwargs={"preload": preload})
        sums = executor.collective_rpc(gloo_sum, self.time_limit_s, (True,))
        assert sums == [float(executor.world_size)] * executor.world_size
        self._freeze_during(executor, gloo_sum)
