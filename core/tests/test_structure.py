"""The core's shape, as issue 50 set it: no import cycle (deferred imports included; imports
for type checkers only excepted), one Executor class with no mixin halves, a backend contract
of at most 15 members listed in one place, and at most 25 names at the root."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import executor_core
from executor_core import Executor
from executor_core.backend import TransportHost

PACKAGE = Path(executor_core.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The core modules ``path`` imports anywhere in its code but under ``TYPE_CHECKING``."""
    name, found = _module_name(path), set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[: len(base) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.update([module, *(f"{module}.{alias.name}" for alias in node.names)])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in modules and m != name}


def test_no_import_cycle_in_the_core() -> None:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: _imports(path, set(paths)) for name, path in paths.items()}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                if nxt == goal:
                    return True
                seen.add(nxt)
                todo.append(nxt)
        return False

    cycles = sorted(f"{a} <-> {b}" for a in graph for b in graph[a] if reaches(b, a))
    assert not cycles, f"import cycles in the core: {cycles}"


def test_the_executor_is_one_class() -> None:
    halves = [c for c in Executor.__mro__[1:] if c.__module__.startswith("executor_core")]
    assert not halves, f"Executor inherits from core classes: {halves}"


def test_the_backend_contract_is_narrow_and_listed_in_one_place() -> None:
    members = sorted(name for name in vars(TransportHost) if not name.startswith("_"))
    members += [name for name in ("config", "name", "worker_env", "restarting", "deliver")]
    members = sorted(set(members))
    assert len(members) <= 15, members
    doc = inspect.getdoc(TransportHost) or ""
    listed = set(re.findall(r":(?:attr|meth):`(\w+)`", doc))
    assert set(members) == listed, f"TransportHost's docstring lists {listed}, not {members}"


def test_the_root_has_at_most_25_names() -> None:
    assert len(executor_core.__all__) <= 25, executor_core.__all__
