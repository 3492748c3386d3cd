"""Helpers shared by the mp backend's tests."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import psutil
import pytest

SHM_PREFIX = "executor-mp-"


def our_shm_names() -> set[str]:
    """Entries in /dev/shm that this backend could have created."""
    return {name for name in os.listdir("/dev/shm") if name.startswith(SHM_PREFIX)}


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until none of ``pids`` runs (zombies count as gone); return those still alive."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


@pytest.fixture
def shm_unchanged() -> Iterator[None]:
    """Fail if the test leaves one of our segments in /dev/shm."""
    before = our_shm_names()
    yield
    assert our_shm_names() - before == set()
