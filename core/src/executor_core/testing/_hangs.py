"""The hang bound: a backend that declares a liveness probe (``Capabilities.liveness_probe``)
declares a frozen rank dead within ``ExecutorConfig.hang_timeout_s``, and leaves a long call
that is alive alone; one that declares none refuses a bound."""

from __future__ import annotations

import os
import signal
from concurrent.futures import Future
from typing import Any, ClassVar

import pytest

from executor_core import (
    ConfigError,
    Executor,
    ExecutorFailedError,
    ExecutorState,
    RecoveryPolicy,
    WorkerDiedError,
)
from executor_core.backend import Transport

from ._base import ExecutorFactory, KitBase
from ._guard import pids_alive, wait_until

__all__ = ["HangTests", "freeze"]


def _join_gloo(worker: Any) -> None:
    """Join a gloo group at the worker's rendezvous and keep it on the worker."""
    from executor_core.torch import init_distributed

    worker.__dict__["_kit_group"] = init_distributed(worker.context, timeout_s=120)


def _all_reduce(worker: Any) -> float:
    import torch
    import torch.distributed as dist

    total = torch.ones(1)
    dist.all_reduce(total)
    return float(total.item())


def _state(pid: int) -> str:
    """The process's state letter (``/proc/PID/stat``; "" where there is none)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def freeze(pid: int, within_s: float = 5.0) -> None:
    """SIGSTOP ``pid`` and return once it is stopped (the signal lands asynchronously, and a
    worker spinning for its next call could otherwise answer one more)."""
    os.kill(pid, signal.SIGSTOP)
    stopped = wait_until(lambda: _state(pid) in ("T", "t"), within_s, 0.001)
    assert stopped, f"process {pid} not stopped {within_s:g} s after SIGSTOP"


class HangTests(KitBase):
    """``hang_timeout_s`` on a backend with a probe: a stopped worker (SIGSTOP, by the pid it
    reports, where a rank runs in a worker process of its own on this machine) is declared
    dead, named, killed and, with a recovery policy, recovered; a worker busy in a long call
    is not."""

    #: The bound the kit sets (seconds); a frozen rank must be declared within
    #: ``hang_grace`` times it, plus ``settle_s``.
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

    def _freeze(self, executor: Executor) -> tuple[int, int, list[str]]:
        """SIGSTOP the highest rank in a worker process of its own: ``(rank, pid, every
        rank's node id)``."""
        contexts = executor.collective_rpc("get_context", timeout=self.time_limit_s)
        victim, pid = self.victim(self.worker_processes(executor))
        freeze(pid)
        return victim, pid, [context.node_id for context in contexts]

    def _declared(self, future: Future[Any], victim: int, pid: int, nodes: list[str]) -> None:
        """Wait for the call in flight to fail naming ``victim`` as hung (and its node, of
        ``nodes`` by rank, where the executor spans several)."""
        limit = self.hang_timeout_s * self.hang_grace + self.settle_s
        try:
            error = future.exception(timeout=limit)
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            pytest.fail(
                f"rule broken: a frozen rank is declared dead within about the hang bound "
                f"({self.hang_timeout_s:g} s); rank {victim} was stopped and the call still "
                f"waits after {limit:g} s"
            )
        assert isinstance(error, WorkerDiedError), (
            f"rule broken: a hung rank fails the call with WorkerDiedError, not {error!r}"
        )
        assert error.ranks == (victim,), (
            f"rule broken: the error names the frozen rank {victim} alone, not {error.ranks} "
            "(the others answered the probe)"
        )
        if len(set(nodes)) > 1:
            assert error.node == nodes[victim], (
                f"rule broken: a hung rank on one of several nodes is named with its node "
                f"{nodes[victim]!r} (as a killed one is), not {error.node!r}"
            )
        assert pids_alive([pid], self.settle_s) == [], (
            f"rule broken: a rank declared hung is killed; pid {pid} still runs"
        )

    def test_hang_bound_is_refused_without_a_probe(self, executor_factory: ExecutorFactory) -> None:
        """Rule: a backend whose spec declares ``Capabilities(liveness_probe=False)`` refuses
        ``hang_timeout_s``, before anything starts, naming the field."""
        if self._probed():
            pytest.skip("the backend declares a probe; the tests below check it")
        with pytest.raises(ConfigError, match="hang_timeout_s"):
            executor_factory(hang_timeout_s=self.hang_timeout_s)

    def test_a_frozen_rank_is_declared_dead(self, fresh_executor: ExecutorFactory) -> None:
        """Rule: a call that runs three times the bound, in workers that answer the probe,
        completes, no rank declared hung. A rank stopped during a call fails that call with
        ``WorkerDiedError`` naming it alone, within the bound; its process is killed; with a
        recovery policy the executor comes back (without one it fails, callbacks told once)."""
        executor = self._hang_executor(fresh_executor)
        failures: list[ExecutorFailedError] = []
        executor.register_failure_callback(failures.append)
        seconds = self.hang_timeout_s * 3
        replies = executor.collective_rpc("slow", args=(seconds, "done"), timeout=self.time_limit_s)
        assert [value for _, value in replies] == ["done"] * executor.world_size, (
            "rule broken: a long call in workers that answer the probe completes"
        )
        state = executor.state
        assert state is ExecutorState.RUNNING, f"rule broken: a long call is no hang ({state})"
        victim, pid, nodes = self._freeze(executor)
        future = executor.collective_rpc("echo", args=("frozen",), non_block=True)
        self._declared(future, victim, pid, nodes)
        if executor.config.recovery is None:
            assert executor.state is ExecutorState.FAILED
            assert len(failures) == 1
            return
        settled = (ExecutorState.RUNNING, ExecutorState.FAILED)
        wait_until(lambda: executor.state in settled, self.time_limit_s)
        assert executor.state is ExecutorState.RUNNING, (
            f"rule broken: a hung rank is recovered ({executor.state}, {executor.failure!r})"
        )
        ranks = executor.collective_rpc("get_rank", timeout=self.time_limit_s)
        assert ranks == list(range(executor.world_size))
        assert not failures

    def test_a_collective_waiting_for_a_frozen_peer(self, fresh_executor: ExecutorFactory) -> None:
        """Rule: ranks blocked in a gloo ``all_reduce`` on a frozen peer answer the probe;
        only the frozen rank is declared, and its death ends the collective."""
        preload = ("torch.distributed", "executor_core.torch")
        if self._probed():
            pytest.importorskip("torch")
        executor = self._hang_executor(fresh_executor, worker_kwargs={"preload": preload})
        executor.collective_rpc(_join_gloo, timeout=self.time_limit_s)
        assert (
            executor.collective_rpc(_all_reduce, timeout=self.time_limit_s)
            == [float(executor.world_size)] * executor.world_size
        )
        victim, pid, nodes = self._freeze(executor)
        future = executor.collective_rpc(_all_reduce, non_block=True)
        self._declared(future, victim, pid, nodes)
