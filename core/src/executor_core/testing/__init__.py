"""The conformance kit for Executor backends, in the style of fsspec's abstract tests.

A backend's test module subclasses :class:`ExecutorConformanceTests` and declares the backend::

    from executor_core.testing import ExecutorConformanceTests

    class TestMyBackend(ExecutorConformanceTests):
        backend = "my-backend"   # its registered name
        world_size = 2

Each area is a mixin of its own. What a backend supports comes from its ``BackendSpec``; which
workers the kit may kill, from the processes they report. A hang fails naming the rule.
"""

from typing import TypeVar

from ._api import (
    AsyncTests,
    CallTests,
    DeviceTests,
    ErrorTests,
    NonBlockingTests,
    PipelineTests,
    SleepTests,
)
from ._base import ExecutorFactory, conformance_config
from ._lifecycle import LifecycleTests
from ._recovery import HangTests, RecoveryTests
from ._workers import ConformanceWorker

__all__ = [
    "AsyncTests",
    "CallTests",
    "ConformanceWorker",
    "DeviceTests",
    "ErrorTests",
    "ExecutorConformanceTests",
    "ExecutorFactory",
    "HangTests",
    "LifecycleTests",
    "NonBlockingTests",
    "PipelineTests",
    "RecoveryTests",
    "SleepTests",
    "conformance_config",
    "layout_variant",
]


class ExecutorConformanceTests(
    # pytest runs the last base's tests first: those of one shared executor come first.
    HangTests,
    RecoveryTests,
    DeviceTests,
    LifecycleTests,
    AsyncTests,
    PipelineTests,
    SleepTests,
    ErrorTests,
    NonBlockingTests,
    CallTests,
):
    """The whole kit: every area."""


#: The tests that build an executor of their own only to start, stop, kill or freeze it and
#: make calls, which the parallel layout (each rank's stage, the output rank) cannot change.
LAYOUT_BLIND_TESTS = (
    *(name for name in vars(LifecycleTests) if name.startswith("test_")),
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
    """Class decorator for a backend's second kit class, in another parallel layout: the
    tests in ``LAYOUT_BLIND_TESTS`` are left to the first class."""
    for name in LAYOUT_BLIND_TESTS:
        if not hasattr(cls, name):
            raise TypeError(f"{cls.__qualname__} has no kit test {name!r} to leave out")
        setattr(cls, name, None)
    return cls
