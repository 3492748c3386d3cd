"""Discovery through real installed entry points, and the `executor` command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from executor_core import (
    ExecutorConfig,
    Registry,
    UnknownBackendError,
    create_executor,
    default_registry,
)
from executor_core.testing import ConformanceWorker

EXECUTOR_CLI = str(Path(sys.executable).with_name("executor"))
BROKEN_FIXTURES = {"fixture_broken_import", "fixture_broken_hook", "fixture_broken_register"}


def test_in_tree_uniproc_is_discovered_with_its_distribution() -> None:
    spec = Registry.from_entry_points().get("uni")
    assert spec.distribution == "executor-plugin-uniproc"
    assert spec.version == "0.1.0"
    assert spec.plugin == "uniproc"
    assert spec.aliases == ("uniproc",)


def test_broken_fixture_plugins_are_recorded_and_uni_still_works() -> None:
    registry = Registry.from_entry_points()
    broken = {b.name: b for b in registry.broken}
    assert set(broken) >= BROKEN_FIXTURES
    assert "executor_fixture_missing_dependency" in broken["fixture_broken_import"].error
    assert "unexpected_argument" in broken["fixture_broken_hook"].error
    assert "fails while declaring" in broken["fixture_broken_register"].error
    assert broken["fixture_broken_import"].distribution == "executor-fixture-plugins"
    config = ExecutorConfig(backend="uni", worker_cls=ConformanceWorker)
    with create_executor(config, registry) as executor:
        assert executor.collective_rpc("get_rank") == [0]


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


def test_cli_backends_table_lists_uni_and_broken_plugins() -> None:
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
    assert "0.1.0" in uni
    assert "Plugins that failed to load:" in result.stdout
    for name in BROKEN_FIXTURES:
        assert name in result.stdout


def test_cli_backends_json() -> None:
    result = _cli("backends", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    uni = next(b for b in payload["backends"] if b["name"] == "uni")
    assert uni["distribution"] == "executor-plugin-uniproc"
    assert uni["capabilities"]["devices"] == ["cpu", "cuda"]
    assert {b["plugin"] for b in payload["broken"]} >= BROKEN_FIXTURES


def test_cli_version_lists_core_and_plugins() -> None:
    result = _cli("--version")
    assert result.returncode == 0, result.stderr
    versions = dict(line.split() for line in result.stdout.splitlines())
    assert versions["executor-core"] == "0.1.0"
    assert versions["executor-plugin-uniproc"] == "0.1.0"


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
