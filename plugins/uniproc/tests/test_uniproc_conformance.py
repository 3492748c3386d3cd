"""The uniproc backend runs the core's whole conformance suite."""

from __future__ import annotations

from typing import Any

import pytest

from executor_core import Executor, create_executor
from executor_core.testing import ExecutorConformanceTests, ExecutorFactory, conformance_config


class TestUniProcConformance(ExecutorConformanceTests):
    @pytest.fixture(scope="class")
    @classmethod
    def executor_factory(cls) -> ExecutorFactory:
        def make(**overrides: Any) -> Executor:
            return create_executor(conformance_config("uni", **overrides))

        return make
