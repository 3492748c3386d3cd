"""Shared pytest set-up for every distribution's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def fresh_default_registry() -> Iterator[None]:
    """Each test sees a freshly loaded default registry (no state leaks between tests)."""
    from executor_core.backend import default_registry

    default_registry.cache_clear()
    yield
    default_registry.cache_clear()
