"""Discovery through real installed entry points, and the `executor` command."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import executor_plugin_uniproc
from executor_core import (
    BackendLoadError,
    ExecutorConfig,
    UnknownBackendError,
    __version__,
    create_executor,
)
from executor_core._registry import ENTRY_POINT_GROUP
from executor_core.backend import Registry, default_registry
from executor_core.testing import ConformanceWorker

EXECUTOR_CLI = str(Path(sys.executable).with_name("executor"))
BROKEN_FIXTURES = {"fixture_broken_import", "fixture_broken_hook", "fixture_broken_register"}


def test_in_tree_uniproc_is_discovered_with_its_distribution() -> None:
    spec = Registry.from_entry_points().get("uni")
    assert spec.distribution == "executor-plugin-uniproc"
    assert spec.version == executor_plugin_uniproc.__version__
    assert spec.plugin == "uniproc"
    assert spec.aliases == ("uniproc",)


def test_broken_fixture_plugins_are_recorded_and_uni_still_works(fixture_plugins: str) -> None:
    registry = Registry.from_entry_points()
    broken = {b.name: b for b in registry.broken}
    assert set(broken) == BROKEN_FIXTURES
    assert "executor_fixture_missing_dependency" in broken["fixture_broken_import"].error
    assert "unexpected_argument" in broken["fixture_broken_hook"].error
    assert broken["fixture_broken_register"].error == (
        "executor_register_backends raised RuntimeError: "
        "fixture plugin fails while declaring its backends"
    )
    assert broken["fixture_broken_import"].distribution == "executor-fixture-plugins"
    assert "fixture plugin fails while declaring" in broken["fixture_broken_register"].traceback
    assert "fixture_observer" in registry.plugins  # a good plugin of the same distribution
    config = ExecutorConfig(backend="uni", worker_cls=ConformanceWorker)
    with create_executor(config, registry) as executor:
        assert executor.collective_rpc("get_rank") == [0]
    # A missing backend's error lists them, with their distribution and errors.
    with pytest.raises(UnknownBackendError) as info:
        registry.get("nothing")
    message = str(info.value)
    assert "Plugins that failed to load:" in message
    assert (
        "  fixture_broken_hook (executor-fixture-plugins 0.0.1): PluginValidationError" in message
    )


def test_the_environment_holds_no_test_fixtures() -> None:
    # The tests' broken plugins are exposed to the tests that ask for them, never installed:
    # a user's `executor backends` must not list them.
    installed = {dist.metadata["Name"] for dist in importlib.metadata.distributions()}
    assert "executor-fixture-plugins" not in installed, (
        "an older dev install left the tests' plugins in this environment; remove them: "
        f"{Path(sys.executable).with_name('pip')} uninstall -y executor-fixture-plugins"
    )
    result = _cli("backends")
    assert result.returncode == 0, result.stderr
    assert "fixture" not in result.stdout
    assert "failed to load" not in result.stdout
    assert {b.name for b in Registry.from_entry_points().broken} == set()


def test_allow_list_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXECUTOR_PLUGINS", "uniproc")
    default_registry.cache_clear()
    registry = default_registry()
    assert set(registry.plugins) == {"uniproc"}
    assert registry.broken == []
    with pytest.raises(UnknownBackendError) as info:
        registry.get("mp")
    assert "EXECUTOR_PLUGINS='uniproc' restricts loading" in str(info.value)
    assert "pip install executor-plugin-multiproc" in str(info.value)
    monkeypatch.setenv("EXECUTOR_PLUGINS", "")
    assert Registry.from_entry_points().plugins == {}


def test_default_registry_is_cached_and_resettable() -> None:
    first = default_registry()
    assert default_registry() is first
    default_registry.cache_clear()
    assert default_registry() is not first


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [EXECUTOR_CLI, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **(env or {})},
    )


def test_cli_backends_table_lists_uni_and_broken_plugins(fixture_plugins: str) -> None:
    result = _cli("backends")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == [
        "NAME",
        "ALIASES",
        "DISTRIBUTION",
        "VERSION",
        "CAPABILITIES",
        "DESCRIPTION",
    ]
    uni = next(line for line in lines if line.startswith("uni "))
    assert "executor-plugin-uniproc" in uni
    assert executor_plugin_uniproc.__version__ in uni.split()
    problems = lines[lines.index("Plugins that failed to load:") + 1 :]
    for name in BROKEN_FIXTURES:
        assert any(
            line.startswith(f"  {name} (executor-fixture-plugins 0.0.1): ") for line in problems
        )


def test_cli_backends_json(fixture_plugins: str) -> None:
    result = _cli("backends", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    uni = next(b for b in payload["backends"] if b["name"] == "uni")
    assert uni["distribution"] == "executor-plugin-uniproc"
    assert uni["aliases"] == ["uniproc"]
    assert uni["capabilities"]["devices"] == ["cpu", "cuda"]
    assert (uni["conflict"], uni["incompatible"]) == (False, "")
    assert {b["plugin"] for b in payload["broken"]} == BROKEN_FIXTURES


def test_cli_version_lists_core_plugins_and_broken_plugins(fixture_plugins: str) -> None:
    result = _cli("--version")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # The problems come after every version line.
    first_problem = lines.index("Plugins that failed to load:")
    versions = dict(line.split() for line in lines[:first_problem])
    assert versions["executor-core"] == __version__
    assert versions["executor-plugin-uniproc"] == executor_plugin_uniproc.__version__
    assert versions["executor-fixture-plugins"] == "0.0.1"  # its observer loaded
    assert (
        "  fixture_broken_import (executor-fixture-plugins 0.0.1): "
        "ModuleNotFoundError: No module named 'executor_fixture_missing_dependency'"
        in lines[first_problem:]
    )


def test_cli_without_plugins_explains_how_to_install() -> None:
    result = _cli("backends", env={"EXECUTOR_PLUGINS": ""})
    assert result.returncode == 0
    assert "pip install executor-plugin-uniproc" in result.stdout


def test_cli_names_in_tree_backends_that_are_not_installed() -> None:
    result = _cli("backends", env={"EXECUTOR_PLUGINS": "uniproc"})
    assert result.returncode == 0, result.stderr
    assert "mp: pip install executor-plugin-multiproc" in result.stdout
    assert "ray: pip install executor-plugin-ray" in result.stdout


def test_every_in_tree_backend_is_installed_in_the_dev_environment() -> None:
    # The cross-backend tests run on the backends that are installed; this makes a missing
    # one a failure instead of a silently shorter test run.
    from backends import IN_TREE, installed_backends

    assert installed_backends() == list(IN_TREE)


def _fake_distribution(
    root: Path, name: str, requires: list[str], plugins: dict[str, str]
) -> dict[str, str]:
    """Write an installed-looking distribution ``name`` 1.0 under ``root``: its metadata
    (``requires`` as Requires-Dist) and one module per plugin (entry-point name -> source).
    Returns entry-point name -> module name."""
    prefix = f"{name.replace('-', '_')}_{root.name.replace('-', '_')}"
    modules = {ep: f"{prefix}_{ep}" for ep in plugins}
    dist_info = root / f"{name.replace('-', '_')}-1.0.dist-info"
    dist_info.mkdir(parents=True)
    metadata = [f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0"]
    metadata.extend(f"Requires-Dist: {req}" for req in requires)
    (dist_info / "METADATA").write_text("\n".join(metadata) + "\n")
    entry_points = [f"[{ENTRY_POINT_GROUP}]"]
    entry_points.extend(f"{ep} = {module}" for ep, module in modules.items())
    (dist_info / "entry_points.txt").write_text("\n".join(entry_points) + "\n")
    for ep, source in plugins.items():
        (root / f"{modules[ep]}.py").write_text(textwrap.dedent(source))
    return modules


FUTURE_PLUGIN = """
    from executor_core.backend import BackendSpec, hookimpl

    @hookimpl
    def executor_register_backends():
        return [BackendSpec(name="future", executor="nowhere_xyz:FutureExecutor")]

    @hookimpl
    def executor_select_backend(config, available):
        return "future"
"""

FORGOT_HOOKIMPL = """
    from executor_core.backend import BackendSpec

    def executor_register_backends():
        return [BackendSpec(name="forgotten", executor="nowhere_xyz:Executor")]
"""


@pytest.fixture
def fake_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Fake distributions on sys.path: one requiring a future executor-core, one whose
    requirement on executor-core applies only elsewhere, one that forgot its @hookimpl, one
    made for an old executor-core that fails to import."""
    _fake_distribution(
        tmp_path, "executor-future", ["attrs", "executor-core>=99"], {"future": FUTURE_PLUGIN}
    )
    _fake_distribution(
        tmp_path,
        "executor-present",
        [
            "executor-core>=0.1",
            "executor-core>=99; python_version < '3'",
            "executor-core>=99; extra == 'next'",
        ],
        {"present": FUTURE_PLUGIN.replace('"future"', '"present"')},
    )
    _fake_distribution(tmp_path, "executor-forgot", [], {"forgot": FORGOT_HOOKIMPL})
    _fake_distribution(
        tmp_path,
        "executor-old",
        ["executor-core<0.1"],
        {"old": "from executor_core import RemovedLongAgo  # noqa: F401\n"},
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_plugin_built_for_another_core_is_listed_and_refused(fake_plugins: Path) -> None:
    registry = Registry.from_entry_points()
    reason = f"requires executor-core>=99; installed {__version__}"
    assert registry.incompatible_plugins == {"future": ("executor-future", "1.0", reason)}
    future = next(s for s in registry.backends() if s.name == "future")
    assert (future.distribution, future.incompatible) == ("executor-future", reason)
    assert "future" not in registry.names()
    assert registry.get("present").incompatible == ""  # the other requirements do not apply
    with pytest.raises(BackendLoadError) as info:
        create_executor(ExecutorConfig(backend="future", worker_cls=ConformanceWorker), registry)
    message = str(info.value)
    assert (
        f"backend 'future' cannot be used: its plugin future (executor-future 1.0) requires "
        f"executor-core>=99, but executor-core {__version__} is installed." in message
    )
    assert "pip install 'executor-core>=99'" in message
    assert f"pip install executor-future executor-core=={__version__}" in message
    # Its selection hook never runs: "auto" asks only compatible plugins.
    assert registry.resolve_name(ExecutorConfig(worker_cls=ConformanceWorker)) == "present"


def test_plugin_without_hookimpl_is_reported_broken(fake_plugins: Path) -> None:
    registry = Registry.from_entry_points()
    broken = {b.name: b for b in registry.broken}
    assert broken["forgot"].distribution == "executor-forgot"
    assert (
        "registers no hook implementation: did you forget @hookimpl on "
        "executor_register_backends?" in broken["forgot"].error
    )
    assert "forgotten" not in {s.name for s in registry.backends()}


def test_plugin_for_another_core_that_fails_to_import_says_why(fake_plugins: Path) -> None:
    broken = {b.name: b for b in Registry.from_entry_points().broken}
    assert "cannot import name 'RemovedLongAgo'" in broken["old"].error
    assert broken["old"].error.endswith(f"(requires executor-core<0.1; installed {__version__})")


def _cli_with(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    pythonpath = os.pathsep.join(filter(None, [str(path), os.environ.get("PYTHONPATH")]))
    return _cli(*args, env={"PYTHONPATH": pythonpath})


def test_cli_shows_incompatible_and_hookless_plugins(fake_plugins: Path) -> None:
    reason = f"requires executor-core>=99; installed {__version__}"
    result = _cli_with(fake_plugins, "backends", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    future = next(b for b in payload["backends"] if b["name"] == "future")
    assert future["incompatible"] == reason
    assert next(b for b in payload["backends"] if b["name"] == "uni")["incompatible"] == ""
    assert payload["incompatible"] == [
        {"plugin": "future", "distribution": "executor-future", "version": "1.0", "reason": reason}
    ]
    assert "forgot" in {b["plugin"] for b in payload["broken"]}

    result = _cli_with(fake_plugins, "backends")
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if line.startswith("future "))
    assert row.split()[1:4] == ["-", "executor-future", "1.0"]
    assert "INCOMPATIBLE" in row
    assert f"  future (executor-future 1.0): {reason}" in result.stdout

    result = _cli_with(fake_plugins, "--version")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    incompatible = lines.index(
        "Plugins built for another executor-core (not used; upgrade or reinstall them):"
    )
    assert f"  future (executor-future 1.0): {reason}" in lines[incompatible:]
    forgot = next(line for line in lines if line.startswith("  forgot (executor-forgot 1.0): "))
    assert "did you forget @hookimpl" in forgot
    assert lines.index("Plugins that failed to load:") < lines.index(forgot) < incompatible
