"""What the recovery tests share: an executor with a recovery policy, a kill of one of its
ranks that waits until the death is seen, and a wait for it to come back."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest

from .._config import ExecutorState, RecoveryPolicy
from .._executor import Executor
from .._transport import Transport
from ._base import ExecutorFactory, KitBase

__all__ = ["RecoveringBase", "gloo_sum"]


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


class RecoveringBase(KitBase):
    """The recovery tests' settings and helpers (:class:`RecoveryTests` holds the rules)."""

    #: Seconds a recovery may take, from a kill to workers ready (a restart of every rank).
    recovery_s: ClassVar[float] = 30.0
    #: Kills in a row in the leak test.
    recovery_kills: ClassVar[int] = 20
    #: False where the backend declares rank replacement but this layout's deaths are
    #: answered by a group restart (say why in the class); the restart's rules are checked
    #: then. None: as the backend declares.
    replaces_ranks: ClassVar[bool | None] = None

    def _recovery(self) -> str:
        spec = self.spec()
        if spec is not None:
            declared = spec.capabilities.recovery
        else:
            transport = getattr(self.backend, "transport_cls", None)
            replaces = transport is not None and transport.replace is not Transport.replace
            declared = "replace" if replaces else "restart"
        if declared == "replace" and self.replaces_ranks is False:
            return "restart"
        return declared

    def _replacing(self) -> None:
        if self._recovery() != "replace":
            pytest.skip("the backend does not declare rank replacement")

    def _policy(self, **overrides: Any) -> RecoveryPolicy:
        return RecoveryPolicy(**{"backoff_s": 0.1, **overrides})

    def _recovering(
        self,
        fresh_executor: ExecutorFactory,
        tmp_path: Path | None = None,
        load_s: float = 0.0,
        worker_kwargs: dict[str, Any] | None = None,
        **policy: Any,
    ) -> Executor:
        if self._recovery() == "none":
            pytest.skip("covered by test_recovery_is_refused_where_not_declared")
        if not self.workers_are_processes:
            pytest.skip("workers_are_processes is False: no worker process to kill")
        kwargs: dict[str, Any] = {"recovery": self._policy(**policy)}
        extra = dict(worker_kwargs or {})
        if tmp_path is not None:
            extra.update(marker_dir=str(tmp_path), load_s=load_s)
        if extra:
            kwargs["worker_kwargs"] = extra
        return fresh_executor(**kwargs)

    def _kill(
        self, executor: Executor, rank: int | None = None, pids: list[int] | None = None
    ) -> tuple[int, int]:
        """Kill a worker (the highest rank whose process is not this one) and wait until the
        executor has seen the death: ``(rank, pid)``."""
        if pids is None:
            pids = executor.collective_rpc("get_pid", timeout=self.recovery_s)
        others = [r for r, pid in enumerate(pids) if pid != os.getpid()]
        assert others, "workers_are_processes is True, but every worker reports the driver's pid"
        victim = others[-1] if rank is None else rank
        os.kill(pids[victim], signal.SIGKILL)
        deadline = time.monotonic() + self.settle_s
        while executor.state is ExecutorState.RUNNING:  # until the death is seen
            assert time.monotonic() < deadline, (
                f"rule broken: a killed rank's death is seen within {self.settle_s:g} s "
                f"(rank {victim}, pid {pids[victim]})"
            )
            time.sleep(0.001)
        return victim, pids[victim]

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
