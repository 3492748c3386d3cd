"""Shared pytest set-up for every distribution's tests."""

from __future__ import annotations

import os
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from third_party import ThirdPartyVenv

#: The tests' plugins (three broken on purpose, one observer): never installed in the
#: environment, exposed to the tests that ask for them by the ``fixture_plugins`` fixture.
FIXTURE_DIST = Path(__file__).parent / "tests" / "fixture_dist"


@pytest.fixture(autouse=True)
def fresh_default_registry() -> Iterator[None]:
    """Each test sees a freshly loaded default registry (no state leaks between tests)."""
    from executor_core.backend import default_registry

    default_registry.cache_clear()
    yield
    default_registry.cache_clear()


@pytest.fixture(scope="session")
def fixture_plugins_metadata(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with tests/fixture_dist's metadata as an install would leave it (a
    ``*.dist-info`` with its entry points, read from its pyproject.toml), for sys.path."""
    project = tomllib.loads((FIXTURE_DIST / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    root = tmp_path_factory.mktemp("fixture-plugins")
    dist_info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir()
    metadata = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    metadata += [f"Requires-Dist: {req}" for req in project.get("dependencies", [])]
    (dist_info / "METADATA").write_text("\n".join(metadata) + "\n")
    (dist_info / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{ep} = {target}\n" for ep, target in eps.items())
            for group, eps in project["entry-points"].items()
        )
    )
    return root


@pytest.fixture
def fixture_plugins(
    fixture_plugins_metadata: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """tests/fixture_dist's plugins, found through their entry points by this test alone.

    Their package and metadata go on ``sys.path`` and on ``PYTHONPATH`` (which the processes
    the test starts inherit) until the test ends. Yields that ``PYTHONPATH``: a backend whose
    workers do not inherit the driver's environment (Ray's) needs it in ``ExecutorConfig.env``.
    """
    paths = [str(fixture_plugins_metadata), str(FIXTURE_DIST / "src")]
    for path in reversed(paths):
        monkeypatch.syspath_prepend(path)
    pythonpath = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])
    monkeypatch.setenv("PYTHONPATH", pythonpath)
    yield pythonpath
    for module in [m for m in sys.modules if m.split(".")[0] == "executor_fixture_plugins"]:
        del sys.modules[module]


@pytest.fixture(scope="session")
def third_party_venv(tmp_path_factory: pytest.TempPathFactory) -> ThirdPartyVenv:
    """A fresh virtual environment with the core's and the example backend's wheels only
    (tests/third_party.py), built once a session (two wheels and an environment take
    seconds): the tests that use it (tests/test_example_backend_wheel.py and
    tests/test_reference_plugin.py) only run its commands; none installs anything into it."""
    from third_party import make_third_party_venv  # tests/: on the path of those that use it

    return make_third_party_venv(tmp_path_factory.mktemp("third-party"))
