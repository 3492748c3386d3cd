"""Conformance suite for Executor backends, in the style of fsspec's abstract tests.

A backend's test module subclasses :class:`ExecutorConformanceTests` and overrides one fixture,
``executor_factory``. Third-party backends run the same suite.
"""

from ._suite import ExecutorConformanceTests, ExecutorFactory, conformance_config
from ._workers import ConformanceWorker, UnpicklableError

__all__ = [
    "ConformanceWorker",
    "ExecutorConformanceTests",
    "ExecutorFactory",
    "UnpicklableError",
    "conformance_config",
]
