"""The conformance kit for Executor backends, in the style of fsspec's abstract tests.

A backend's test module subclasses :class:`ExecutorConformanceTests` and declares the backend::

    from executor_core.testing import ExecutorConformanceTests

    class TestMyBackend(ExecutorConformanceTests):
        backend = "my-backend"   # its registered name
        world_size = 2

Every area is a mixin of its own (:class:`CallTests`, :class:`NonBlockingTests`,
:class:`ErrorTests`, :class:`LifecycleTests`, :class:`SleepTests`, :class:`PipelineTests`,
:class:`DeviceTests`, :class:`AsyncTests`, :class:`RecoveryTests`, :class:`HangTests`);
what a backend supports comes from its :class:`~executor_core.backend.BackendSpec`, and
whether its workers are processes the kit may kill from the pids they report. Each test runs
under a time limit, so a hang fails with the rule it broke.
"""

from ._async import AsyncTests
from ._base import ExecutorFactory, conformance_config
from ._calls import CallTests, ErrorTests, NonBlockingTests
from ._device import DeviceTests
from ._hangs import HangTests
from ._lifecycle import LifecycleTests
from ._pipeline import PipelineTests
from ._recovery import RecoveryTests
from ._sleep import SleepTests
from ._variants import layout_variant
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
    AsyncTests,  # first: pytest runs a base's tests after those of the bases listed after it
    CallTests,
    NonBlockingTests,
    ErrorTests,
    LifecycleTests,
    SleepTests,
    PipelineTests,
    DeviceTests,
    RecoveryTests,
    HangTests,
):
    """The whole kit: every area."""
