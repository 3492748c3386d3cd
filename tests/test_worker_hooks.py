"""Worker-side hooks fire inside each worker process, on every installed backend.

The observer is a real plugin (tests/fixture_dist, entry point ``fixture_observer``, exposed
by the ``fixture_plugins`` fixture) so worker processes and actors load it through the same
entry points as the driver.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from backends import installed_backends, world_size_for

from executor_core import WorkerError, create_executor
from executor_core.testing import conformance_config


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize(
    "backend",
    [
        # Ray needs a session of its own here: seconds.
        pytest.param(name, marks=pytest.mark.slow) if name == "ray" else name
        for name in installed_backends()
    ],
)
def test_worker_hooks_see_lifecycle_and_every_rpc(
    backend: str, tmp_path: Path, fixture_plugins: str
) -> None:
    log = tmp_path / "hooks.jsonl"
    world_size = world_size_for(backend)
    # PYTHONPATH for Ray's actors, which start from the cluster's environment, not this one.
    env = {"EXECUTOR_FIXTURE_OBSERVER_LOG": str(log), "PYTHONPATH": fixture_plugins}
    config = conformance_config(backend, world_size=world_size, env=env)
    with create_executor(config) as executor:
        executor.collective_rpc("get_rank")
        with pytest.raises(WorkerError):
            executor.collective_rpc("fail", args=("observed",))
    events = _events(log)
    for rank in range(world_size):
        mine = [e for e in events if e["rank"] == rank]
        kinds = [e["event"] for e in mine]
        assert kinds[:2] == ["process_started", "ready"], kinds
        assert kinds[-1] == "stopping"
        rpcs = [(e["method"], e["error"]) for e in mine if e["event"] == "rpc"]
        assert ("get_rank", None) in rpcs
        assert ("fail", "ValueError") in rpcs
        assert all(e["duration_s"] >= 0 for e in mine if e["event"] == "rpc")
        assert mine[0]["backend"] == backend
