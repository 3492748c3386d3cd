"""Meta-tests, as datasette has: every hook is documented and exercised by a test."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from executor_core import _hooks as _hookspecs

ROOT = Path(__file__).resolve().parent.parent
HOOKS = sorted(
    name
    for name, obj in vars(_hookspecs).items()
    if name.startswith("executor_") and inspect.isfunction(obj)
)


def test_there_are_hooks() -> None:
    assert len(HOOKS) >= 6


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_documented(hook: str) -> None:
    docs = (ROOT / "docs" / "hooks.md").read_text()
    assert re.search(rf"^### {hook}$", docs, re.MULTILINE), f"docs/hooks.md lacks '### {hook}'"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_tested(hook: str) -> None:
    test_files = [
        p
        for pattern in (
            "core/tests/*.py",
            "plugins/*/tests/*.py",
            "tests/*.py",
            "tests/fixture_dist/**/*.py",
        )
        for p in ROOT.glob(pattern)
        if p.name != "test_docs.py"
    ]
    assert any(hook in p.read_text() for p in test_files), f"no test implements or calls {hook}"


def test_documented_hooks_exist() -> None:
    docs = (ROOT / "docs" / "hooks.md").read_text()
    documented = re.findall(r"^### (executor_\w+)$", docs, re.MULTILINE)
    assert sorted(documented) == HOOKS
