"""The hang bound: a backend that declares a liveness probe (``Capabilities.liveness_probe``)
declares a frozen rank dead within ``ExecutorConfig.hang_timeout_s``, and leaves a long call
that is alive alone; one that declares none refuses a bound."""

from __future__ import annotations

import os
import signal
import time
from typing import Any, ClassVar

import pytest

from .._config import ExecutorState, RecoveryPolicy
from .._errors import ConfigError, ExecutorFailedError, WorkerDiedError
from .._executor import Executor
from .._transport import Transport
from ._base import ExecutorFactory, KitBase
from ._guard import pids_alive

__all__ = ["HangTests"]


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


def freeze(pid: int, within_s: float = 5.0) -> None:
    """SIGSTOP ``pid`` and return once it is stopped: the signal lands asynchronously, and a
    worker spinning for its next call on another core could otherwise answer one more."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + within_s
    while _state(pid) not in ("T", "t"):
        assert time.monotonic() < deadline, (
            f"process {pid} not stopped {within_s:g} s after SIGSTOP"
        )
        time.sleep(0.001)


def _state(pid: int) -> str:
    """The process's state letter (``/proc/PID/stat``; "" where there is none)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


class HangTests(KitBase):
    """``hang_timeout_s`` on a backend with a probe: a stopped worker (SIGSTOP, by the pid it
    reports; ``workers_are_processes``) is declared dead, named, killed and, with a recovery
    policy, recovered; a worker busy in a long call is not."""

    #: The bound the kit sets (seconds); a frozen rank must be declared within
    #: ``hang_grace`` times it, plus ``settle_s`` (a call waits the bound, then the rank
    #: answers no probe for the bound).
    hang_timeout_s: ClassVar[float] = 1.0
    hang_grace: ClassVar[float] = 3.5

    def _probed(self) -> bool:
        spec = self.spec()
        if spec is not None:
            return spec.capabilities.liveness_probe
        backend = self.backend  # an unregistered class: what its transport implements
        transport = getattr(backend, "transport_cls", None)
        return (
            isinstance(transport, type)
            and issubclass(transport, Transport)
            and transport.can_probe()
        )

    def _hang_executor(self, fresh_executor: ExecutorFactory, **config: Any) -> Executor:
        if not self._probed():
            pytest.skip("covered by test_hang_bound_is_refused_without_a_probe")
        if not self.workers_are_processes:
            pytest.skip("workers_are_processes is False: no worker process to stop")
        spec = self.spec()
        if spec is not None and spec.capabilities.recovery != "none":
            config.setdefault("recovery", RecoveryPolicy(backoff_s=0.1))
        return fresh_executor(hang_timeout_s=self.hang_timeout_s, **config)

    def _freeze(self, executor: Executor) -> tuple[int, int, list[str]]:
        """SIGSTOP the highest rank whose process is not this one: ``(rank, pid, every
        rank's node id)``."""
        contexts = executor.collective_rpc("get_context", timeout=self.time_limit_s)
        pids = executor.collective_rpc("get_pid", timeout=self.time_limit_s)
        others = [r for r, pid in enumerate(pids) if pid != os.getpid()]
        assert others, "workers_are_processes is True, but every worker reports the driver's pid"
        victim = others[-1]
        freeze(pids[victim])
        return victim, pids[victim], [context.node_id for context in contexts]

    def _declared(self, future: Any, victim: int, pid: int, nodes: list[str]) -> None:
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
        """Rule: a rank stopped during a call fails that call with ``WorkerDiedError`` naming
        it alone and saying it hung, within the bound; its process is killed; with a recovery
        policy the executor comes back (without one it fails, callbacks told once)."""
        executor = self._hang_executor(fresh_executor)
        failures: list[ExecutorFailedError] = []
        executor.register_failure_callback(failures.append)
        victim, pid, nodes = self._freeze(executor)
        future = executor.collective_rpc("echo", args=("frozen",), non_block=True)
        self._declared(future, victim, pid, nodes)
        if executor.config.recovery is None:
            assert executor.state is ExecutorState.FAILED
            assert len(failures) == 1
            return
        deadline = time.monotonic() + self.time_limit_s
        while executor.state is not ExecutorState.RUNNING:
            assert executor.state is not ExecutorState.FAILED, executor.failure
            assert time.monotonic() < deadline, "rule broken: a hung rank is recovered"
            time.sleep(0.02)
        assert executor.collective_rpc("get_rank", timeout=self.time_limit_s) == list(
            range(executor.world_size)
        )
        assert not failures

    def test_a_collective_waiting_for_a_frozen_peer(self, fresh_executor: ExecutorFactory) -> None:
        """Rule: ranks blocked in a gloo ``all_reduce`` on a frozen peer answer the probe;
        only the frozen rank is declared, and its death ends the collective."""
        pytest.importorskip("torch")
        preload = ("torch.distributed", "executor_core.torch")
        executor = self._hang_executor(fresh_executor, worker_kwargs={"preload": preload})
        executor.collective_rpc(_join_gloo, timeout=self.time_limit_s)
        assert (
            executor.collective_rpc(_all_reduce, timeout=self.time_limit_s)
            == [float(executor.world_size)] * executor.world_size
        )
        victim, pid, nodes = self._freeze(executor)
        future = executor.collective_rpc(_all_reduce, non_block=True)
        self._declared(future, victim, pid, nodes)

    def test_a_long_call_that_is_alive_is_not_killed(self, fresh_executor: ExecutorFactory) -> None:
        """Rule: a call that runs three times the bound, in workers that answer the probe,
        completes; no rank is declared hung."""
        executor = self._hang_executor(fresh_executor)
        seconds = self.hang_timeout_s * 3
        replies = executor.collective_rpc("slow", args=(seconds, "done"), timeout=self.time_limit_s)
        assert [value for _, value in replies] == ["done"] * executor.world_size
        assert executor.state is ExecutorState.RUNNING
