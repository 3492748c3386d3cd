"""The docs say what the repository holds: their tables and lists are read against the code.

Every fact is found afresh in the repository on each run (distributions are the directories
with a ``pyproject.toml``, hooks the ``@hookspec`` functions, kit areas the classes
``ExecutorConformanceTests`` combines, private modules the ``_*.py`` files of a package), so
a new module, hook, area or distribution fails here until the docs name it, and a doc naming
something gone fails too. Where a doc lists things, the list is found by a marker:

- README.md: the table of the ``## Layout`` section (a row per distribution and top-level
  folder; a row's first cell holds its paths);
- docs/architecture.md and docs/index.md: the table whose first header cell is
  ``distribution``;
- docs/architecture.md, ``## Hooks``: a bullet ``- Driver side`` and a bullet ``- Worker side``;
  docs/hooks.md: each ``### executor_...`` under a ``## Driver side...`` or ``## Worker side...``
  heading;
- docs/writing-a-backend.md and docs/architecture.md: the sentence that says ``split by area``;
- a distribution's README: the paragraph that starts ``Private modules:``, or a table whose
  first header cell is ``private module``;
- docs/writing-a-backend.md: the ``toml`` block with a ``[project]`` table, which must agree
  with the named distribution's pyproject.toml in every key it shows.

In every hand-written doc (README.md, CONTRIBUTING.md, docs/, each README), the dotted names of
the SDK's modules, the repository's paths and the relative links must resolve.
"""

from __future__ import annotations

import fnmatch
import functools
import inspect
import os
import re
import subprocess
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
GUIDE = "docs/writing-a-backend.md"
ARCHITECTURE = "docs/architecture.md"
HOOKS = "docs/hooks.md"
PRIVATE_MARKER = "Private modules:"
AREA_MARKER = "split by area"

# --- the repository -----------------------------------------------------------------------


@functools.cache
def _repo_files() -> tuple[str, ...]:
    """Every file of the repository, tracked or new (not ignored), as a path from the root."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT,
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout.decode()
        names = out.split("\0")
    except (OSError, subprocess.SubprocessError):  # not a git checkout: walk it instead
        names = _walk()
    return tuple(sorted(name for name in names if name and (ROOT / name).is_file()))


def _walk() -> list[str]:
    """The files under the root, leaving out dot-folders and what .gitignore names."""
    ignore = ROOT / ".gitignore"
    patterns = [
        line.strip().strip("/")
        for line in (ignore.read_text().splitlines() if ignore.exists() else [])
        if line.strip() and not line.startswith("#")
    ]

    def ignored(name: str) -> bool:
        return name.startswith(".") or any(fnmatch.fnmatch(name, p) for p in patterns)

    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not ignored(d)]
        base = Path(folder).relative_to(ROOT)
        found += [(base / f).as_posix() for f in files if not ignored(f)]
    return found


@functools.cache
def _distributions() -> dict[str, str]:
    """``{"dir/": project name}`` of every directory with a pyproject.toml, but the root."""
    found = {}
    for name in _repo_files():
        path = PurePosixPath(name)
        if path.name == "pyproject.toml" and path.parent != PurePosixPath("."):
            project = tomllib.loads((ROOT / name).read_text())["project"]
            found[f"{path.parent}/"] = project["name"]
    return found


def _product_distributions() -> dict[str, str]:
    """The distributions that are not test fixtures (not under ``tests/``)."""
    return {d: n for d, n in _distributions().items() if not d.startswith("tests/")}


def _top_level_folders() -> set[str]:
    return {
        name.split("/")[0] for name in _repo_files() if "/" in name and not name.startswith(".")
    }


def _package(directory: str) -> Path:
    """The one import package of a distribution (``src/<package>/__init__.py``)."""
    packages = sorted((ROOT / directory / "src").glob("*/__init__.py"))
    assert len(packages) == 1, f"{directory}: expected one package under src/, got {packages}"
    return packages[0].parent


def _packages() -> dict[str, Path]:
    """``{import name: package directory}`` of every distribution."""
    found = {}
    for directory in _distributions():
        for init in (ROOT / directory / "src").glob("*/__init__.py"):
            found[init.parent.name] = init.parent
    return found


def _private_modules(package: Path) -> set[str]:
    """``_name.py`` files and ``_name/`` packages directly in ``package`` (no dunders)."""
    names = {p.name for p in package.glob("_*.py") if not p.name.startswith("__")}
    names |= {
        f"{p.name}/"
        for p in package.iterdir()
        if p.is_dir() and p.name.startswith("_") and not p.name.startswith("__")
        if (p / "__init__.py").exists()
    }
    return names


def _hook_specs() -> set[str]:
    """The functions marked ``@hookspec`` in executor_core._hooks."""
    from executor_core import _hooks as _hookspecs

    marker = f"{_hookspecs.PROJECT_NAME}_spec"
    return {
        name
        for name, obj in vars(_hookspecs).items()
        if inspect.isfunction(obj) and hasattr(obj, marker)
    }


def _kit_areas() -> set[str]:
    """The areas of the conformance kit: the classes with tests that the whole kit combines."""
    from executor_core import testing
    from executor_core.testing._base import KitBase

    return {
        cls.__name__
        for cls in testing.ExecutorConformanceTests.__mro__[1:]
        if issubclass(cls, KitBase) and any(n.startswith("test_") for n in vars(cls))
    }


# --- markdown -------------------------------------------------------------------------------


def _read(doc: str) -> str:
    return (ROOT / doc).read_text()


def _prose(text: str) -> str:
    """``text`` with the lines of fenced code blocks blanked (a ``# comment`` is no heading)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return "\n".join(out) + "\n"


def _code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.M | re.S)


def _section(text: str, title: str, doc: str) -> str:
    """The body under the heading ``title``, up to the next heading of its level or higher."""
    prose = _prose(text)
    match = re.search(rf"^(#+) {re.escape(title)}[ \t]*$", prose, re.M)
    assert match, f"{doc} has no heading '{title}'"
    rest = prose[match.end() :]
    end = re.search(rf"^#{{1,{len(match[1])}}} ", rest, re.M)
    return rest[: end.start()] if end else rest


def _cells(line: str) -> list[str]:
    """A table row's cells (a ``|`` inside backticks is text)."""
    cells, cell, code = [], "", False
    for char in line.strip().strip("|"):
        if char == "`":
            code = not code
        if char == "|" and not code:
            cells.append(cell.strip())
            cell = ""
        else:
            cell += char
    return [*cells, cell.strip()]


def _tables(text: str) -> list[list[list[str]]]:
    """Every table of ``text`` (prose only): rows of cells, the header first."""
    tables: list[list[list[str]]] = []
    previous = False
    for line in _prose(text).splitlines():
        row = line.lstrip().startswith("|")
        if row and not re.fullmatch(r"[\s|:-]+", line):
            if not previous:
                tables.append([])
            tables[-1].append(_cells(line))
        previous = row
    return tables


def _table(text: str, header: str, doc: str) -> list[list[str]]:
    """The rows (no header) of the table whose first header cell is ``header``."""
    found = [t for t in _tables(text) if t[0][0].lower() == header]
    assert len(found) == 1, f"{doc}: expected one table headed '| {header} |', found {len(found)}"
    return found[0][1:]


def _sentence(text: str, marker: str, doc: str) -> str:
    """From ``marker`` to the end of its sentence (a period outside brackets, then a space)."""
    prose = _prose(text)
    start = prose.find(marker)
    assert start >= 0, f"{doc} no longer says '{marker}'"
    depth = 0
    for end in range(start, len(prose)):
        char = prose[end]
        depth += (char in "([") - (char in ")]")
        if char == "." and depth == 0 and prose[end + 1 : end + 2].isspace():
            return prose[start:end]
    return prose[start:]


def _ticked(text: str, pattern: str = r"[^`]+") -> list[str]:
    return re.findall(rf"`({pattern})`", text)


def _unlisted(expected: set[str], listed: set[str], where: str, why: str, gone: str) -> list[str]:
    """What ``where`` lacks (``why`` it should list it) and what it lists that is ``gone``."""
    return [f"{where} lacks `{name}` ({why})" for name in sorted(expected - listed)] + [
        f"{where} names `{name}`, which {gone}" for name in sorted(listed - expected)
    ]


# --- README.md's layout ---------------------------------------------------------------------


def _layout() -> list[list[str]]:
    return _table(_section(_read("README.md"), "Layout", "README.md"), "path", "README.md")


def _layout_paths() -> list[str]:
    return [path for row in _layout() for path in _ticked(row[0])]


def test_readme_layout_has_a_row_per_distribution() -> None:
    rows = {path.rstrip("/") + "/": row for row in _layout() for path in _ticked(row[0])}
    problems = []
    for directory, name in sorted(_distributions().items()):
        row = rows.get(directory)
        if row is None:
            problems.append(f"no row for `{directory}` (the distribution `{name}`)")
        elif f"`{name}`" not in " | ".join(row):
            problems.append(f"the row of `{directory}` does not name `{name}`")
    assert not problems, "README.md's Layout table: " + "; ".join(problems)


def test_readme_layout_covers_every_top_level_folder() -> None:
    paths = [path.rstrip("/") for path in _layout_paths()]
    missing = sorted(
        folder
        for folder in _top_level_folders()
        if not any(p == folder or p.startswith(f"{folder}/") for p in paths)
    )
    assert not missing, f"README.md's Layout table has no row for {missing}"


def test_readme_layout_paths_exist() -> None:
    gone = [path for path in _layout_paths() if not (ROOT / path).exists()]
    assert not gone, f"README.md's Layout table names paths that do not exist: {gone}"


# --- the distribution tables ------------------------------------------------------------------


@pytest.mark.parametrize("doc", [ARCHITECTURE, "docs/index.md"])
def test_distribution_table_lists_every_distribution(doc: str) -> None:
    first = " ".join(row[0] for row in _table(_read(doc), "distribution", doc))
    names = set(_product_distributions().values())
    shown = set(re.findall(r"(?<![\w-])executor-[\w-]*\w", first))
    problems = _unlisted(
        names,
        shown,
        f"{doc}'s distribution table",
        "a distribution of this repository: a pyproject.toml names it",
        "no pyproject.toml of this repository names",
    )
    assert not problems, "\n".join(problems)


# --- hooks ------------------------------------------------------------------------------------


def _hooks_md_sides() -> dict[str, set[str]]:
    """``{"driver": names, "worker": names}`` from docs/hooks.md's headings."""
    sides: dict[str, set[str]] = {"driver": set(), "worker": set()}
    side = None
    for line in _prose(_read(HOOKS)).splitlines():
        if heading := re.fullmatch(r"## (\w+) side\b.*", line):
            side = heading[1].lower()
            assert side in sides, f"{HOOKS}: '{line}' is neither a driver nor a worker side"
        elif hook := re.fullmatch(r"### (executor_\w+)\s*", line):
            assert side, f"{HOOKS}: `{hook[1]}` comes before any '## ... side' heading"
            sides[side].add(hook[1])
    return sides


def test_hooks_md_documents_every_hook_spec() -> None:
    sides = _hooks_md_sides()
    both = sides["driver"] & sides["worker"]
    assert not both, f"{HOOKS} documents {sorted(both)} on both sides"
    problems = _unlisted(
        _hook_specs(),
        sides["driver"] | sides["worker"],
        f"{HOOKS}'s '### hook' headings",
        "an @hookspec function of executor_core._hooks",
        "is no @hookspec function of executor_core._hooks",
    )
    assert not problems, "\n".join(problems)


def test_architecture_lists_every_hook_on_its_side() -> None:
    section = _section(_read(ARCHITECTURE), "Hooks", ARCHITECTURE)
    problems = []
    for side, documented in _hooks_md_sides().items():
        bullet = re.search(rf"^- {side} side\b(.*?)(?=^- |\n\n|\Z)", section, re.M | re.S | re.I)
        if bullet is None:
            problems.append(f"{ARCHITECTURE}'s Hooks section has no bullet '- {side.title()} side'")
            continue
        listed = set(_ticked(bullet[1], r"executor_\w+"))
        problems += _unlisted(
            documented & _hook_specs(),
            listed,
            f"{ARCHITECTURE}'s Hooks bullet '{side.title()} side'",
            f"a hook spec, on that side in {HOOKS}",
            f"is no hook spec on that side in {HOOKS}",
        )
    assert not problems, "\n".join(problems)


# --- the conformance kit ----------------------------------------------------------------------


@pytest.mark.parametrize("doc", [GUIDE, ARCHITECTURE])
def test_kit_areas_match_the_kit(doc: str) -> None:
    sentence = _sentence(_read(doc), AREA_MARKER, doc)
    listed = set(_ticked(sentence, r"\w+Tests")) - {"ExecutorConformanceTests"}
    problems = _unlisted(
        _kit_areas(),
        listed,
        f"{doc}'s '{AREA_MARKER}' list",
        "a mixin with tests that ExecutorConformanceTests combines",
        "is no mixin with tests that ExecutorConformanceTests combines",
    )
    assert not problems, "\n".join(problems)


# --- private modules in the READMEs -----------------------------------------------------------


def _listing(text: str) -> set[str] | None:
    """The private modules a README lists, or ``None`` if it has no list."""
    prose = _prose(text)
    found: set[str] | None = None
    if (start := prose.find(PRIVATE_MARKER)) >= 0:
        end = prose.find("\n\n", start)
        found = set(_ticked(prose[start : end if end >= 0 else None], r"_\w+(?:\.py|/)"))
    for table in _tables(prose):
        if table[0][0].lower() == "private module":
            cells = " ".join(row[0] for row in table[1:])
            found = (found or set()) | set(_ticked(cells, r"_\w+(?:\.py|/)"))
    return found


def _readmes() -> list[str]:
    return [d for d in sorted(_distributions()) if (ROOT / d / "README.md").exists()]


def test_some_readme_lists_private_modules() -> None:
    """The marker is still in use: otherwise the test below would check nothing."""
    listed = [d for d in _readmes() if _listing(_read(f"{d}README.md"))]
    assert listed, f"no README has a '{PRIVATE_MARKER}' paragraph or '| private module |' table"


@pytest.mark.parametrize("directory", _readmes())
def test_readme_private_modules_match_the_package(directory: str) -> None:
    readme = f"{directory}README.md"
    package = _package(directory)
    actual = _private_modules(package)
    text = _read(readme)
    listed = _listing(text)
    if listed is None:
        named = sorted(actual & set(_ticked(_prose(text), r"_\w+\.py")))
        assert not named, (
            f"{readme} names private modules {named} but has no '{PRIVATE_MARKER}' list: "
            f"list all of {package.relative_to(ROOT)}'s there"
        )
        return
    problems = _unlisted(
        actual,
        listed,
        f"{readme}'s private modules",
        f"it is in {package.relative_to(ROOT)}",
        f"is not in {package.relative_to(ROOT)}",
    )
    assert not problems, "\n".join(problems)


# --- the guide's pyproject ------------------------------------------------------------------


def _differences(shown: Any, real: Any, key: str = "") -> list[str]:
    """Where ``shown`` (a part of a TOML document) disagrees with ``real``, key by key."""
    if not (isinstance(shown, dict) and isinstance(real, dict)):
        return [] if shown == real else [f"`{key}`: shown {shown!r}, the file has {real!r}"]
    problems = []
    for name, value in shown.items():
        path = f"{key}.{name}" if key else name
        if name in real:
            problems += _differences(value, real[name], path)
        else:
            problems.append(f"`{path}`: shown, but not in the file")
    return problems


def test_guide_pyproject_matches_the_example() -> None:
    blocks = [b for b in _code_blocks(_read(GUIDE), "toml") if re.search(r"^\[project\]", b, re.M)]
    assert len(blocks) == 1, f"{GUIDE}: expected one toml block with [project], got {len(blocks)}"
    shown = tomllib.loads(blocks[0])
    name = shown["project"]["name"]
    directory = {n: d for d, n in _distributions().items()}.get(name)
    assert directory, f"{GUIDE} shows the pyproject.toml of `{name}`, which is no distribution here"
    assert "requires-python" in shown["project"], f"{GUIDE}'s pyproject shows no requires-python"
    real = tomllib.loads(_read(f"{directory}pyproject.toml"))
    problems = _differences(shown, real)
    where = f"{GUIDE}'s pyproject.toml against {directory}pyproject.toml"
    assert not problems, f"{where}: " + "; ".join(problems)


# --- references in the docs -----------------------------------------------------------------


def _docs() -> list[str]:
    """The hand-written docs: README.md, CONTRIBUTING.md, docs/, every README."""
    return [
        name
        for name in _repo_files()
        if name in {"README.md", "CONTRIBUTING.md"}
        or (name.startswith("docs/") and name.endswith(".md"))
        or name.endswith("/README.md")
    ]


def _exists(base: Path, path: str) -> bool:
    return next(iter(base.glob(path)), None) is not None if "*" in path else (base / path).exists()


def _module(package: Path, parts: list[str]) -> Path | None:
    path = package.joinpath(*parts)
    if (path / "__init__.py").exists():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").exists() else None


def _dotted_name_problems(text: str) -> list[str]:
    """``executor_x.module.Name``: the longest module prefix exists, and holds the next name."""
    problems = []
    packages = _packages()
    for match in re.finditer(r"(?<![\w./(-])(executor_\w+)((?:\.\w+)+)(?::(\w+))?", text):
        if match[1] not in packages:
            continue
        parts = match[2].lstrip(".").split(".") + ([match[3]] if match[3] else [])
        depth = next(i for i in range(len(parts), -1, -1) if _module(packages[match[1]], parts[:i]))
        module = _module(packages[match[1]], parts[:depth])
        assert module is not None
        if depth < len(parts) and not re.search(rf"\b{parts[depth]}\b", module.read_text()):
            dotted = ".".join([match[1], *parts[:depth]])
            problems.append(f"`{match[0]}`: no module or name `{parts[depth]}` in `{dotted}`")
    return problems


def _path_problems(doc: str, text: str) -> list[str]:
    """``folder/...`` (a top-level folder's path), from the root, the doc or a distribution."""
    folders = "|".join(re.escape(f) for f in sorted(_top_level_folders()))
    bases = [ROOT, (ROOT / doc).parent, *(ROOT / d for d in _distributions())]
    return [
        f"the path `{path}` does not exist"
        for match in re.finditer(rf"(?<![\w./$<>-])((?:{folders})/[\w./*-]*)", text)
        if not any(_exists(base, path := match[1].rstrip(".")) for base in bases)
    ]


def _link_problems(doc: str, text: str) -> list[str]:
    """Relative markdown links, inline or reference-style, from the doc's folder."""
    problems = []
    for match in re.finditer(r"\]\(([^)\s]+)\)|^\[[^\]]+\]:\s*(\S+)", _prose(text), re.M):
        link = (match[1] or match[2]).split("#")[0]
        if link and not re.match(r"\w+:", link) and not ((ROOT / doc).parent / link).exists():
            problems.append(f"the link ({link}) leads nowhere")
    return problems


@pytest.mark.parametrize("doc", _docs())
def test_doc_references_exist(doc: str) -> None:
    """Dotted names of the SDK's modules, repository paths and relative links all resolve."""
    text = _read(doc)
    problems = _dotted_name_problems(text) + _path_problems(doc, text) + _link_problems(doc, text)
    assert not problems, f"{doc}: " + "; ".join(dict.fromkeys(problems))
