"""The mp backend runs the core's whole conformance kit, with tensor and pipeline ranks."""

from __future__ import annotations

from typing import ClassVar

from executor_core.testing import ExecutorConformanceTests


class TestMultiprocConformance(ExecutorConformanceTests):
    """Two tensor-parallel workers."""

    #: A process per worker: the kit kills one and checks its death is reported.
    workers_are_processes: ClassVar[bool] = True

    backend = "mp"
    world_size = 2


class TestMultiprocPipelineConformance(ExecutorConformanceTests):
    """One tensor-parallel rank per stage, two pipeline stages (output rank 1), by alias.

    Two worker processes on one node, as in TestMultiprocConformance. Neither the backend nor
    the core's start, shutdown, recovery and hang bound look at the layout, which only sets
    each rank's WorkerContext (its stage), the output rank and the batches in flight. So the
    tests that build an executor of their own only to start, stop, kill or freeze it and make
    calls (the lifecycle area, two of the errors', and the recovery and hang-bound tests
    below) are TestMultiprocConformance's alone: here they would build the same executor but
    for the stage numbers and the alias, which every other test here goes through (``None``:
    not collected). Those that see the layout run here too: the worker contexts,
    execute_model and its output rank, the contexts kept across a restart, and gloo's groups
    (a pipeline group per TP rank, warmed up with a send between stages) after a restart and
    around a frozen rank.
    """

    backend = "multiproc"
    world_size = 2
    pipeline_parallel_size = 2
    workers_are_processes: ClassVar[bool] = True
    # The lifecycle area (LifecycleTests), whole.
    test_failure_callbacks_run_once = None
    test_fail_fails_calls_in_flight = None
    test_shutdown_is_idempotent_and_final = None
    test_shutdown_with_calls_in_flight = None
    test_context_manager_shuts_down = None
    test_env_reaches_workers_not_the_driver = None
    test_worker_kwargs = None
    test_worker_init_failure_fails_creation = None
    test_shutdown_stops_every_worker = None
    test_dropped_executor_is_collected_and_cleaned_up = None
    test_hooks_reach_in_process_workers = None
    test_shutdown_removes_temporary_files = None
    test_killed_worker_fails_the_call_in_flight = None
    # ErrorTests' own executors (the rest of the area shares the class's executor).
    test_default_timeout_from_config = None
    test_unsendable_call_fails_by_its_deadline = None
    # RecoveryTests and HangTests that only make calls.
    test_kills_in_a_row_leave_nothing_behind = None
    test_a_second_death_during_the_recovery = None
    test_an_exhausted_policy_fails_the_executor_once = None
    test_calls_during_a_recovery_fail_at_once_when_told_to = None
    test_callers_on_four_threads_during_a_recovery = None
    test_a_frozen_rank_is_declared_dead = None
    test_a_long_call_that_is_alive_is_not_killed = None
