"""The docs site (mkdocs.yml) has an API reference for every public name.

A name is public when it is in its module's ``__all__`` (or, in a module without one, a
function or class defined there without a leading underscore); a module is public when no
part of its dotted name starts with an underscore. Every public module of every distribution
must have a ``::: module`` directive in ``docs/api/*.md``; a directive with default members
covers the module's ``__all__``, and ``::: module.Name`` covers one name; each such name must
be visible in the source (griffe, which builds the reference, reads it without importing).
The build itself
(``mkdocs build --strict``, which fails on a broken link or cross-reference) is run by
scripts/test.sh, not here.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import griffe
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
API_DIR = ROOT / "docs" / "api"

#: ``::: identifier``, then optionally an indented YAML block (``options: ...``).
_DIRECTIVE = re.compile(r"^::: *(?P<id>[\w.]+) *\n(?P<yaml>(?:[ \t]+\S.*\n|[ \t]*\n)*)", re.M)


def _source_dirs() -> list[Path]:
    """``<distribution>/src`` of every distribution in the repository (not test fixtures)."""
    found = {
        pyproject.parent / "src"
        for pattern in ("*/pyproject.toml", "*/*/pyproject.toml")
        for pyproject in ROOT.glob(pattern)
        if pyproject.parts[len(ROOT.parts)] not in {"tests", ".venv"}
        and (pyproject.parent / "src").is_dir()
    }
    return sorted(found)


def _public_modules(src: Path) -> list[str]:
    """The dotted names of the public modules and packages under ``src``."""
    modules = []
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if parts and not any(part.startswith("_") for part in parts):
            modules.append(".".join(parts))
    return modules


def _directives() -> dict[str, list[dict[str, Any]]]:
    """Every ``:::`` identifier in docs/api/*.md, with the options of each of its directives."""
    found: dict[str, list[dict[str, Any]]] = {}
    for page in sorted(API_DIR.glob("*.md")):
        text = page.read_text()
        if not text.endswith("\n"):
            text += "\n"
        for match in _DIRECTIVE.finditer(text):
            block = yaml.safe_load(_dedent(match["yaml"])) or {}
            found.setdefault(match["id"], []).append(dict(block.get("options") or {}))
    return found


def _dedent(block: str) -> str:
    lines = [line for line in block.splitlines() if line.strip()]
    indent = min((len(line) - len(line.lstrip()) for line in lines), default=0)
    return "\n".join(line[indent:] for line in lines)


def _public_names(module: ModuleType) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isfunction(value) or inspect.isclass(value))
        and value.__module__ == module.__name__
    ]


def _covered(module: str, name: str, directives: dict[str, list[dict[str, Any]]]) -> bool:
    if f"{module}.{name}" in directives:
        return True
    for options in directives.get(module, []):
        members = options.get("members")
        if members is None or members is True:
            return True
        if isinstance(members, list) and name in members:
            return True
    return False


class _ConfigLoader(yaml.SafeLoader):
    """Reads mkdocs.yml; its tags (``!ENV``, ``!!python/name:``) are read as None."""


_ConfigLoader.add_multi_constructor("!", lambda loader, suffix, node: None)
_ConfigLoader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)


def _mkdocs_paths() -> list[str]:
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_ConfigLoader)  # a SafeLoader
    for plugin in config["plugins"]:
        if isinstance(plugin, dict) and "mkdocstrings" in plugin:
            paths: list[str] = plugin["mkdocstrings"]["handlers"]["python"]["paths"]
            return paths
    raise AssertionError("mkdocs.yml has no mkdocstrings plugin")


@functools.cache
def _static_package(package: str) -> griffe.Module:
    """``package`` as the API reference's builder (griffe) reads it: from the source, without
    importing (a lazily imported name it cannot see is not rendered)."""
    loader = griffe.GriffeLoader(search_paths=[str(ROOT / path) for path in _mkdocs_paths()])
    module = loader.load(package)
    assert isinstance(module, griffe.Module), package
    return module


def _static_members(module: str) -> set[str]:
    package = _static_package(module.partition(".")[0])
    return set(package[module.partition(".")[2]].members if "." in module else package.members)


SOURCE_DIRS = _source_dirs()
PUBLIC_MODULES = [module for src in SOURCE_DIRS for module in _public_modules(src)]


def test_there_are_distributions_and_pages() -> None:
    assert len(SOURCE_DIRS) >= 7
    assert "executor_core" in PUBLIC_MODULES
    assert len(_directives()) >= 10


def test_every_distribution_is_on_the_handler_paths() -> None:
    expected = sorted(str(src.relative_to(ROOT)) for src in SOURCE_DIRS)
    assert sorted(_mkdocs_paths()) == expected, (
        "mkdocs.yml: plugins/mkdocstrings/handlers/python/paths must list every "
        "distribution's src directory"
    )


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_public_module_has_a_page(module: str) -> None:
    assert module in _directives(), (
        f"no '::: {module}' in docs/api/*.md: add it to its distribution's page "
        "(and the page to the nav of mkdocs.yml)"
    )


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_public_names_have_a_reference(module: str) -> None:
    names = _public_names(importlib.import_module(module))
    directives = _directives()
    missing = [name for name in names if not _covered(module, name, directives)]
    assert not missing, f"public names of {module} missing from docs/api/*.md: {missing}"
    unseen = sorted(set(names) - _static_members(module))
    assert not unseen, (
        f"{module}: {unseen} are public but not visible in its source, so the API reference "
        "cannot render them (import each lazily loaded name under 'if TYPE_CHECKING:')"
    )


def test_documented_identifiers_exist() -> None:
    for identifier in _directives():
        module, _, name = identifier.rpartition(".")
        if identifier in PUBLIC_MODULES:
            importlib.import_module(identifier)
        else:
            assert module, identifier
            assert hasattr(importlib.import_module(module), name), identifier


def test_changelog_page_starts_at_the_release_notes() -> None:
    """docs/changelog.md includes CHANGELOG.md from the line of towncrier's start marker (the
    header above it is the page's own)."""
    page = (ROOT / "docs" / "changelog.md").read_text()
    match = re.search(r'^--8<-- "CHANGELOG\.md:(\d+)"$', page, re.M)
    assert match, "docs/changelog.md no longer includes CHANGELOG.md by line"
    lines = (ROOT / "CHANGELOG.md").read_text().splitlines()
    line = int(match[1])
    assert lines[line - 1].strip() == "<!-- towncrier release notes start -->", (
        f"CHANGELOG.md:{line} is not towncrier's start marker: fix the line in docs/changelog.md"
    )
