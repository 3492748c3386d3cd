"""Which in-tree backends the cross-backend tests run on, and how to build their configs."""

from __future__ import annotations

from executor_core.backend import Registry

#: Every in-tree backend; the dev install (requirements-dev.txt) installs all of them, and
#: tests/test_discovery.py fails if one is missing, so none is silently left out.
IN_TREE = ("uni", "mp", "ray")


def installed_backends() -> list[str]:
    """The in-tree backends whose plugin is installed and loads."""
    names = set(Registry.from_entry_points().names())
    return [name for name in IN_TREE if name in names]


def world_size_for(backend: str) -> int:
    """The largest world size a test uses on ``backend`` (``uni`` runs one worker)."""
    return 1 if backend == "uni" else 2
