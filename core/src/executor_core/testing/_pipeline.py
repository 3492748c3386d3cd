"""Pipeline and limits: what the backend declares is what it does."""

from __future__ import annotations

import pytest

from executor_core import ExecutorError

from ._base import ExecutorFactory, KitBase

__all__ = ["PipelineTests"]


class PipelineTests(KitBase):
    """A backend that declares pipeline parallelism runs it; one that does not refuses it."""

    def test_pipeline_parallel_as_declared(self, fresh_executor: ExecutorFactory) -> None:
        spec = self.spec()
        if spec is None:
            pytest.skip("an unregistered executor class declares no capabilities")
        if not spec.capabilities.pipeline_parallel:
            with pytest.raises(ExecutorError, match="pipeline"):
                fresh_executor(pipeline_parallel_size=2, world_size=2)
            return
        executor = fresh_executor(pipeline_parallel_size=2, world_size=2)
        assert executor.output_rank == 1
        assert executor.max_concurrent_batches == 2
        futures = [executor.execute_model(i, non_block=True) for i in range(4)]
        assert [f.result(timeout=30) for f in futures] == [
            {"rank": 1, "batch": i} for i in range(4)
        ], "rule broken: a pipeline's steps complete in order, from the last stage's rank"

    def test_world_size_limit_as_declared(self, fresh_executor: ExecutorFactory) -> None:
        spec = self.spec()
        if spec is None or spec.capabilities.max_world_size is None:
            assert self.world_size >= 1
            return
        limit = spec.capabilities.max_world_size
        with pytest.raises(ExecutorError, match="at most"):
            fresh_executor(world_size=limit + 1)
