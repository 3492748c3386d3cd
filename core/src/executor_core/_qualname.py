"""Resolve ``"package.module:Attr"`` strings to objects, with errors that say what went wrong."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["preload_worker", "qualname_of", "resolve_qualname"]


def resolve_qualname(qualname: str) -> Any:
    """Import ``"package.module:Attr.sub"`` and return the attribute.

    Raises :class:`ImportError` naming the module or attribute that could not be found.
    """
    module_name, sep, attr_path = qualname.partition(":")
    if not sep or not module_name or not attr_path:
        raise ImportError(
            f"{qualname!r} is not a qualified name; write it as 'package.module:ClassName'"
        )
    module = importlib.import_module(module_name)
    obj: Any = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(
                f"module {module_name!r} has no attribute {attr_path!r} (from {qualname!r})"
            ) from None
    return obj


def qualname_of(obj: Any) -> str:
    """The ``"module:QualName"`` string that :func:`resolve_qualname` turns back into ``obj``."""
    return f"{obj.__module__}:{obj.__qualname__}"


def preload_worker(worker_cls: type | str) -> None:
    """Import the module that defines ``worker_cls`` (a class, or its ``"module:Class"``
    name), and torch with it for a torch worker: what a warm spare, a process that waits to
    be handed a rank, does ahead, so that the hand-over pays no import. Raises what the
    import raises; a spare ignores it, since the rank's own start then fails the same way,
    with its traceback."""
    if isinstance(worker_cls, str):
        resolve_qualname(worker_cls)
    else:
        importlib.import_module(worker_cls.__module__)
