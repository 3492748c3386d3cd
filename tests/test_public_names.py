"""Every public name has a user: another distribution, an example, or the docs.

A name is public when it is in the ``__all__`` of a public module (no part of its dotted name
starts with an underscore) of a distribution in this repository (a directory with a
``pyproject.toml`` and a ``src``; test fixtures aside). Each must be

- used by the Python source of another distribution (its ``src``), of ``examples/``, or of
  the repository's own tools that drive the distributions from outside (``scripts/``, such
  as the GPU check): imported from the module (``from module import name``), reached as an
  attribute of it (``module.name``), or named in a string (``"module:name"``, as in
  ``worker_cls``); or
- documented for third parties: written as code (in backticks or a fenced block) in a
  hand-written page of ``docs/`` (not a ``:::`` directive, which renders whatever ``__all__``
  holds), in README.md or in a distribution's README.

Everything is found afresh in the repository's files on each run, so a name added to an
``__all__`` and used nowhere fails here, naming the module and the name.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Public names of executor-channel and executor-plugin-multiproc that nothing uses yet (empty
#: now that their public faces are documented): only these two distributions may have entries
#: here, and an entry must be dropped (the test fails) once the name is used or no longer
#: public. Do not add to it: use the name, document it, or make it private.
ALLOWED_UNUSED: dict[str, frozenset[str]] = {}
_ALLOW_LIST_DISTRIBUTIONS = ("executor_channel", "executor_plugin_multiproc")


def _distributions() -> list[Path]:
    """The directory of every distribution in the repository (not test fixtures)."""
    found = {
        pyproject.parent
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


def _public_names() -> list[tuple[Path, str, str]]:
    """(distribution, module, name) for each name in a public module's ``__all__``."""
    names = []
    for distribution in _distributions():
        for module in _public_modules(distribution / "src"):
            for name in getattr(importlib.import_module(module), "__all__", ()):
                names.append((distribution, module, name))
    return names


# --- users in Python source -------------------------------------------------------------------

#: ``"module:name"`` (an import path, as in ``worker_cls``) or ``"module.name"``.
_REFERENCE = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?::[A-Za-z_]\w*)?")


def _dotted_splits(dotted: str) -> Iterator[tuple[str, str]]:
    """``a.b.c`` -> (a, b), (a.b, c): every (module, name) it may reach."""
    parts = dotted.split(".")
    for i in range(1, len(parts)):
        yield ".".join(parts[:i]), parts[i]


def _python_uses(path: Path) -> set[tuple[str, str]]:
    """The (module, name) pairs that one Python file uses."""
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (SyntaxError, UnicodeDecodeError):
        return set()
    uses: set[tuple[str, str]] = set()
    aliases: dict[str, str] = {}  # a local name -> the dotted module (or name) it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            uses.update(_dotted_splits(node.module))
            for alias in node.names:
                uses.add((node.module, alias.name))
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    top = alias.name.partition(".")[0]
                    aliases[top] = top
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and _REFERENCE.fullmatch(node.value)
        ):
            module, colon, name = node.value.partition(":")
            if colon:
                uses.add((module, name))
            uses.update(_dotted_splits(module))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = []
            value: ast.expr = node
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in aliases:
                uses.update(_dotted_splits(".".join([aliases[value.id], *reversed(chain)])))
    return uses


@functools.cache
def _source_uses() -> dict[tuple[str, str], set[Path]]:
    """(module, name) -> the distributions (or folders) whose source uses it."""
    owners = _distributions()
    trees = [distribution / "src" for distribution in owners]
    trees += [ROOT / "examples", ROOT / "scripts"]
    found: dict[tuple[str, str], set[Path]] = {}
    for tree in trees:
        for path in sorted(tree.rglob("*.py")):
            owner = next((d for d in owners if path.is_relative_to(d)), tree)
            for use in _python_uses(path):
                found.setdefault(use, set()).add(owner)
    return found


# --- users in the docs ------------------------------------------------------------------------


def _doc_files() -> list[Path]:
    """The hand-written docs: docs/ (its pages, not what they include), every README."""
    pages = sorted((ROOT / "docs").rglob("*.md"))
    readmes = [ROOT / "README.md"] + [d / "README.md" for d in _distributions()]
    return pages + [readme for readme in readmes if readme.is_file()]


_FENCE = re.compile(r"^ *(```|~~~).*?^ *\1", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)


def _code(text: str) -> str:
    """The code of a markdown text: fenced blocks and code spans (not ``:::`` directives)."""
    text = "\n".join(line for line in text.splitlines() if not line.startswith(":::"))
    blocks = [match.group(0) for match in _FENCE.finditer(text)]
    prose = _FENCE.sub("", text)
    spans = [match.group(2) for match in _CODE_SPAN.finditer(prose)]
    return "\n".join(blocks + spans)


@functools.cache
def _doc_words() -> dict[str, set[Path]]:
    """Each word written as code in a doc -> the docs that write it."""
    found: dict[str, set[Path]] = {}
    for doc in _doc_files():
        for word in set(re.findall(r"[A-Za-z_]\w*", _code(doc.read_text()))):
            found.setdefault(word, set()).add(doc)
    return found


# --- the rule ---------------------------------------------------------------------------------


def _users(distribution: Path, module: str, name: str) -> list[str]:
    sources = _source_uses().get((module, name), set()) - {distribution}
    docs = _doc_words().get(name, set())
    return sorted(str(path.relative_to(ROOT)) for path in sources | docs)


PUBLIC_NAMES = _public_names()


def test_there_are_public_names() -> None:
    modules = {module for _, module, _ in PUBLIC_NAMES}
    assert {"executor_core", "executor_core.backend", "executor_channel"} <= modules
    assert len(PUBLIC_NAMES) > 100


def test_every_public_name_has_a_user() -> None:
    unused = [
        f"{module}.{name}"
        for distribution, module, name in PUBLIC_NAMES
        if not _users(distribution, module, name)
        and name not in ALLOWED_UNUSED.get(module, frozenset())
    ]
    assert not unused, (
        "public names (in a public module's __all__) that no other distribution, example, "
        "benchmark or script uses and no doc (docs/, a README) names as code: "
        + ", ".join(unused)
        + ". Use each where it is meant to be used, document it for third parties (in "
        "backticks on the docs page that covers it), or make it private: drop it from "
        "__all__ (and the lazy-import table) and import it from its private module."
    )


def test_the_allow_list_holds_only_unused_names_of_two_distributions() -> None:
    assert all(module.startswith(_ALLOW_LIST_DISTRIBUTIONS) for module in ALLOWED_UNUSED), (
        "ALLOWED_UNUSED may only hold names of executor-channel and executor-plugin-multiproc"
    )
    public = {(module, name): distribution for distribution, module, name in PUBLIC_NAMES}
    stale = [
        f"{module}.{name}"
        for module, names in ALLOWED_UNUSED.items()
        for name in sorted(names)
        if (module, name) not in public or _users(public[module, name], module, name)
    ]
    assert not stale, (
        "ALLOWED_UNUSED lists names that are no longer public or now have a user; drop them: "
        + ", ".join(stale)
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from a.b import c as d\n", {("a.b", "c"), ("a", "b")}),
        ("import a.b\na.b.c\n", {("a", "b"), ("a.b", "c")}),
        ("import a.b as m\nm.c\n", {("a.b", "c")}),
        ("from a import b\nb.c\n", {("a", "b"), ("a.b", "c")}),
        ("x = 'a.b:C'\n", {("a.b", "C"), ("a", "b")}),
        ("from . import c\n", set()),
    ],
)
def test_python_uses(tmp_path: Path, source: str, expected: set[tuple[str, str]]) -> None:
    path = tmp_path / "user.py"
    path.write_text(source)
    assert expected <= _python_uses(path)
    if not expected:
        assert not _python_uses(path)


def test_doc_code_is_code_spans_and_fences_only() -> None:
    text = "Prose Alpha, `Beta()` and\n\n```python\nGamma\n```\n\n::: mod.Delta\n"
    words = set(re.findall(r"\w+", _code(text)))
    assert {"Beta", "Gamma"} <= words
    assert not {"Prose", "Alpha", "Delta"} & words
