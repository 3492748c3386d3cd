"""Every distribution of the repository is complete on its own, and its version has one source."""

from __future__ import annotations

import ast
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
    "plugins/kubernetes": ("executor-plugin-kubernetes", "executor_plugin_kubernetes"),
    "examples/executor-threads": ("executor-threads", "executor_threads"),
    "examples/executor-cluster": ("executor-cluster", "executor_cluster"),
    "bench": ("executor-bench", "executor_bench"),
    "reference": ("executor-reference", "executor_reference"),
    "plugins/otel": ("executor-plugin-otel", "executor_plugin_otel"),
    "plugins/vllm": ("executor-vllm", "executor_vllm"),
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


#: The most lines a script may have (one job per file).
MAX_MODULE_LINES = 400

#: Lines of Python a distribution's ``src/`` may hold, in all (the core's kit and torch helpers
#: counted apart): budgets per distribution, not a cap per module, which was met by cutting
#: classes into halves rather than by cutting work (a module is as long as its job). A change
#: that adds lines finds them within its distribution's budget, or takes them out elsewhere
#: in it. Issue 50's targets: core 4,000, its kit 2,000, its torch helpers 1,100; issue 51's:
#: channel 3,500, multiproc 1,800, ray 1,300, slurm 600, otel 450, uniproc 250.
LINE_BUDGETS = {
    "core": 4_700,
    "core/testing": 2_000,
    "core/torch": 1_100,
    "channel": 6_910,
    "plugins/uniproc": 250,
    "plugins/multiproc": 2_123,
    "plugins/ray": 2_070,
    "plugins/slurm": 726,
    "plugins/kubernetes": 700,
    "plugins/otel": 450,
    "examples/executor-threads": 150,
    "examples/executor-cluster": 150,
    "bench": 3_920,
    "reference": 2_150,
    "plugins/vllm": 800,
}
#: The parts of a distribution counted apart from it (by their folder in its package).
_PARTS = {"core/testing": ("core", "testing"), "core/torch": ("core", "torch")}


def _lines(part: str) -> int:
    directory, sub = _PARTS.get(part, (part, ""))
    _, package = DISTRIBUTIONS[directory]
    root = ROOT / directory / "src" / package
    apart = [root / folder for d, folder in _PARTS.values() if d == directory and not sub]
    paths = (root / sub).rglob("*.py")
    return sum(
        path.read_text().count("\n")
        for path in paths
        if not any(path.is_relative_to(folder) for folder in apart)
    )


def test_every_distribution_has_a_line_budget() -> None:
    assert set(LINE_BUDGETS) == set(DISTRIBUTIONS) | set(_PARTS)


@pytest.mark.parametrize("part", sorted(LINE_BUDGETS))
def test_each_distribution_is_within_its_line_budget(part: str) -> None:
    lines, budget = _lines(part), LINE_BUDGETS[part]
    assert lines <= budget, (
        f"{part}/src holds {lines} lines of Python, over its budget of {budget}: find the "
        "lines within the distribution (what can go?) rather than raising the budget"
    )


def _imported(path: Path) -> list[str]:
    """Every module and ``module.name`` that ``path`` imports (absolute imports only)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return names


def _private(name: str) -> bool:
    return "._" in name.replace(".__", ".")


def _product_files() -> dict[Path, str | None]:
    """Every Python file that ships or that a user runs, with the package it belongs to
    (None for the scripts, which belong to none)."""
    files: dict[Path, str | None] = {}
    for directory, (_, package) in DISTRIBUTIONS.items():
        for path in (ROOT / directory / "src" / package).rglob("*.py"):
            files[path] = package
    for path in (ROOT / "scripts").glob("*.py"):
        files[path] = None
    return files


def test_no_private_import_across_distributions() -> None:
    """Issue 26: product code and scripts use only the public faces of the other
    distributions (a distribution's own tests may reach into it)."""
    found = {}
    for path, package in _product_files().items():
        bad = [
            name
            for name in _imported(path)
            if (
                name.startswith("executor_") and name.split(".", 1)[0] != package and _private(name)
            )
            or (package is None and name.startswith("ray.") and _private(name))
        ]
        if bad:
            found[str(path.relative_to(ROOT))] = sorted(set(bad))
    assert not found, f"private names of another distribution imported: {found}"


def test_scripts_are_under_the_bound() -> None:
    over = {
        str(path.relative_to(ROOT)): lines
        for path, package in _product_files().items()
        if package is None and (lines := path.read_text().count("\n")) > MAX_MODULE_LINES
    }
    assert not over, f"scripts over {MAX_MODULE_LINES} lines (split them by job): {over}"
