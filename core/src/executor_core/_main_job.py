"""``executor run``: the main job. For now a small demo that drives a worker on any backend."""

from __future__ import annotations

import argparse
import time
from typing import Any

from ._worker import WorkerBase, WorkerContext

__all__ = ["DemoWorker", "add_run_arguments", "run_main_job"]


class DemoWorker(WorkerBase):
    """Sums a shard of a range per rank: enough to show every rank doing its part."""

    def __init__(self, *, context: WorkerContext, scale: int = 1) -> None:
        super().__init__(context=context)
        self.scale = scale

    def execute_model(self, batch: Any) -> Any:
        n = int(batch)
        shard = range(self.rank, n, self.world_size)
        return {"rank": self.rank, "partial_sum": self.scale * sum(shard)}


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``executor run``."""
    parser.add_argument("--backend", default="uni", help="backend name, alias or 'auto'")
    parser.add_argument("--steps", type=int, default=10, help="execute_model calls to make")


def run_main_job(args: argparse.Namespace) -> int:
    """Run the demo and print a summary."""
    from ._config import ExecutorConfig
    from ._executor import create_executor

    config = ExecutorConfig(backend=args.backend, worker_cls=DemoWorker)
    start = time.perf_counter()
    with create_executor(config) as executor:
        ready = time.perf_counter()
        for step in range(args.steps):
            executor.execute_model(1000 + step)
        done = time.perf_counter()
        print(
            f"backend={type(executor).__name__} world_size={executor.world_size} "
            f"steps={args.steps} ready_in={ready - start:.3f}s "
            f"step_mean={(done - ready) / max(args.steps, 1) * 1e6:.1f}us"
        )
    return 0
