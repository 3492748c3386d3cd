"""A second kit class for one backend in another parallel layout: only the tests that see it."""

from __future__ import annotations

from typing import TypeVar

__all__ = ["LAYOUT_BLIND_TESTS", "layout_variant"]

#: The kit's tests that build an executor of their own only to start, stop, kill or freeze
#: it and make calls. A backend's start, shutdown, recovery and hang bound do not look at
#: the layout (tp x pp), which sets only each rank's context (its stage), the output rank
#: and the batches in flight, so in a second layout these build the same executor but for
#: the stage numbers. The tests that see the layout (worker contexts, execute_model and its
#: output rank, contexts kept across a restart, gloo's groups after a restart and around a
#: frozen rank) run in every layout.
LAYOUT_BLIND_TESTS = (
    # The lifecycle area (LifecycleTests), whole.
    "test_failure_callbacks_run_once",
    "test_fail_fails_calls_in_flight",
    "test_shutdown_is_idempotent_and_final",
    "test_shutdown_with_calls_in_flight",
    "test_context_manager_shuts_down",
    "test_env_reaches_workers_not_the_driver",
    "test_worker_kwargs",
    "test_worker_init_failure_fails_creation",
    "test_shutdown_stops_every_worker",
    "test_dropped_executor_is_collected_and_cleaned_up",
    "test_hooks_reach_in_process_workers",
    "test_shutdown_removes_temporary_files",
    "test_killed_worker_fails_the_call_in_flight",
    "test_a_death_is_reported_once_as_a_death",
    # ErrorTests' own executors (the rest of the area shares the class's executor).
    "test_default_timeout_from_config",
    "test_unsendable_call_fails_by_its_deadline",
    # RecoveryTests and HangTests that only make calls.
    "test_kills_in_a_row_leave_nothing_behind",
    "test_a_second_death_during_the_recovery",
    "test_an_exhausted_policy_fails_the_executor_once",
    "test_calls_during_a_recovery_fail_at_once_when_told_to",
    "test_callers_on_four_threads_during_a_recovery",
    "test_a_frozen_rank_is_declared_dead",
    "test_a_long_call_that_is_alive_is_not_killed",
)

_Kit = TypeVar("_Kit", bound=type)


def layout_variant(cls: _Kit) -> _Kit:
    """Class decorator for a backend's second kit class that differs from its first only in
    the parallel layout (``pipeline_parallel_size``, ``world_size``): the tests in
    :data:`LAYOUT_BLIND_TESTS` are left to the first class (not collected here), so that the
    variant costs only what the layout can change."""
    for name in LAYOUT_BLIND_TESTS:
        if not hasattr(cls, name):
            raise TypeError(f"{cls.__qualname__} has no kit test {name!r} to leave out")
        setattr(cls, name, None)
    return cls
