"""A second kit class for one backend in another parallel layout: only the tests that see it."""

from __future__ import annotations

from typing import TypeVar

__all__ = ["LAYOUT_BLIND_TESTS", "layout_variant"]

#: The tests that build an executor of their own only to start, stop, kill or freeze it and
#: make calls: the layout (tp x pp) sets only each rank's stage, the output rank and the
#: batches in flight, which these do not look at. The tests that see the layout (contexts,
#: execute_model, contexts and gloo groups after a restart or around a frozen rank) run in
#: every layout.
LAYOUT_BLIND_TESTS = (
    "test_failure_callbacks_run_once",
    "test_shutdown_is_idempotent_and_final",
    "test_shutdown_with_calls_in_flight",
    "test_env_reaches_workers_not_the_driver",
    "test_worker_init_failure_fails_creation",
    "test_shutdown_stops_every_worker",
    "test_dropped_executor_is_collected_and_cleaned_up",
    "test_killed_worker_fails_the_call_in_flight",
    "test_a_death_is_reported_once_as_a_death",
    "test_default_timeout_from_config",
    "test_unsendable_call_fails_by_its_deadline",
    "test_kills_in_a_row_leave_nothing_behind",
    "test_a_second_death_during_the_recovery",
    "test_calls_during_a_recovery_fail_at_once_when_told_to",
    "test_callers_on_four_threads_during_a_recovery",
    "test_a_frozen_rank_is_declared_dead",
)

_Kit = TypeVar("_Kit", bound=type)


def layout_variant(cls: _Kit) -> _Kit:
    """Class decorator for a backend's second kit class that differs from its first only in
    the parallel layout (``pipeline_parallel_size``, ``world_size``): the tests in
    :data:`LAYOUT_BLIND_TESTS` are left to the first class (not collected here)."""
    for name in LAYOUT_BLIND_TESTS:
        if not hasattr(cls, name):
            raise TypeError(f"{cls.__qualname__} has no kit test {name!r} to leave out")
        setattr(cls, name, None)
    return cls
