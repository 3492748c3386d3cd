"""Sleep: the executor's sleep tags follow the workers'."""

from __future__ import annotations

import pytest

from executor_core import SLEEP_TAGS, Executor, SleepStateError

from ._base import KitBase

__all__ = ["SleepTests"]


class SleepTests(KitBase):
    """``sleep`` and ``wake_up`` reach every worker and keep the tags right."""

    def test_sleep_and_wake_up(self, executor: Executor) -> None:
        ws = executor.world_size
        assert executor.sleeping_tags == frozenset()
        executor.sleep(level=1)
        assert executor.is_sleeping
        assert executor.sleeping_tags == frozenset(SLEEP_TAGS)
        assert executor.collective_rpc("sleep_state") == [sorted(SLEEP_TAGS)] * ws
        executor.wake_up(["weights"])
        assert executor.sleeping_tags == frozenset({"kv_cache"})
        assert executor.collective_rpc("sleep_state") == [["kv_cache"]] * ws
        with pytest.raises(SleepStateError, match="not asleep"):
            executor.wake_up(["weights"])
        executor.wake_up()
        assert executor.sleeping_tags == frozenset()
        assert executor.is_sleeping == bool(executor.sleeping_tags)
        assert executor.collective_rpc("sleep_state") == [[]] * ws

    def test_sleep_errors(self, executor: Executor) -> None:
        with pytest.raises(SleepStateError, match="level"):
            executor.sleep(level=3)
        with pytest.raises(SleepStateError, match="unknown sleep tags"):
            executor.wake_up(["gpu"])
        with pytest.raises(SleepStateError, match="not asleep"):
            executor.wake_up(["kv_cache"])
        executor.wake_up()  # nothing asleep: a no-op
