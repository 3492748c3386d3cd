"""Every distribution of the repository is complete on its own, and its version has one source."""

from __future__ import annotations

import importlib
import importlib.metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: directory -> (distribution, package)
DISTRIBUTIONS = {
    "core": ("executor-core", "executor_core"),
    "channel": ("executor-channel", "executor_channel"),
    "plugins/uniproc": ("executor-plugin-uniproc", "executor_plugin_uniproc"),
    "plugins/multiproc": ("executor-plugin-multiproc", "executor_plugin_multiproc"),
    "plugins/ray": ("executor-plugin-ray", "executor_plugin_ray"),
    "plugins/slurm": ("executor-plugin-slurm", "executor_plugin_slurm"),
    "examples/executor-threads": ("executor-threads", "executor_threads"),
    "examples/executor-cluster": ("executor-cluster", "executor_cluster"),
    "bench": ("executor-bench", "executor_bench"),
    "reference": ("executor-reference", "executor_reference"),
    "plugins/otel": ("executor-plugin-otel", "executor_plugin_otel"),
}


@pytest.mark.parametrize("directory", sorted(DISTRIBUTIONS))
def test_distribution_is_complete(directory: str) -> None:
    _, package = DISTRIBUTIONS[directory]
    base = ROOT / directory
    for name in ("pyproject.toml", "README.md", "LICENSE", f"src/{package}/py.typed"):
        assert (base / name).is_file(), f"{directory} lacks {name}"
    assert (base / "LICENSE").read_text() == (ROOT / "LICENSE").read_text()
    pyproject = (base / "pyproject.toml").read_text()
    # The version is read from the package, never written in pyproject.toml.
    assert 'dynamic = ["version"]' in pyproject
    assert "\nversion =" not in pyproject
    assert 'requires-python = ">=3.11"' in pyproject


@pytest.mark.parametrize("directory", sorted(DISTRIBUTIONS))
def test_installed_version_is_the_packages(directory: str) -> None:
    distribution, package = DISTRIBUTIONS[directory]
    module = importlib.import_module(package)
    assert importlib.metadata.version(distribution) == module.__version__


#: The most lines a product module may have (issue 26: one job per module; scripts/ has the
#: same bound in test_gpu_check_script.py).
MAX_MODULE_LINES = 400


@pytest.mark.parametrize("directory", sorted(DISTRIBUTIONS))
def test_no_module_is_over_the_bound(directory: str) -> None:
    _, package = DISTRIBUTIONS[directory]
    over = {
        str(path.relative_to(ROOT)): lines
        for path in sorted((ROOT / directory / "src" / package).rglob("*.py"))
        if (lines := path.read_text().count("\n")) > MAX_MODULE_LINES
    }
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them by job): {over}"
