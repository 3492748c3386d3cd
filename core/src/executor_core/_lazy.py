"""PEP 562 lazy attributes for a plugin package: its user-facing names load on first use."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``name`` from the relative module
    ``table[name]`` on first use (and caches it in the package's namespace).

    A plugin's ``__init__`` is imported in every process that loads the registry, so it must
    not import its backend's code; its user-facing names still import from the package."""

    def __getattr__(name: str) -> Any:
        where = table.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(package)
        value = getattr(importlib.import_module(where, package), name)
        setattr(module, name, value)  # later lookups skip __getattr__
        return value

    return __getattr__
