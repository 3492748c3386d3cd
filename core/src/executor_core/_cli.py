"""The ``executor`` command: list backends, show versions, and the plugins' subcommands.

The core's own commands are ``backends`` and ``--version``; every other command comes from a
plugin's ``executor_register_commands`` hook (``run`` from executor-reference, ``node`` from
executor-plugin-multiproc, ...).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import attrs

from ._registry import IN_TREE_BACKENDS, Registry, default_registry, plugin_problems
from ._version import __version__

__all__ = ["IN_TREE_COMMANDS", "build_parser", "main"]

#: Commands that distributions of this repository add, by name, with the distribution that
#: provides each (used for the install hint when one is asked for but not installed, as
#: IN_TREE_BACKENDS is for backends).
IN_TREE_COMMANDS: dict[str, str] = {
    "run": "executor-reference",
    "node": "executor-plugin-multiproc",
    "bench": "executor-bench",
}


def _not_installed(in_tree: Mapping[str, str], present: Collection[str]) -> list[str]:
    """``"name: pip install distribution"`` for each distribution of ``in_tree`` (name ->
    distribution) with a name missing from ``present``, sorted by distribution."""
    missing: dict[str, str] = {}
    for name, dist in in_tree.items():
        if name not in present:
            missing.setdefault(dist, name)
    return [f"{name}: pip install {dist}" for dist, name in sorted(missing.items())]


def _versions(registry: Registry) -> dict[str, str]:
    versions = {"executor-core": __version__}
    for _name, (dist, version) in sorted(registry.plugins.items()):
        if dist:
            versions[dist] = version
    return versions


def _backends_payload(registry: Registry) -> dict[str, Any]:
    """What ``executor backends --json`` prints: each backend's spec, and what is wrong."""
    conflicts = registry.conflicts()
    return {
        "backends": [
            {**attrs.asdict(spec), "conflict": spec.name in conflicts}
            for spec in registry.backends()
        ],
        "broken": [
            {
                "plugin": b.name,
                "distribution": b.distribution,
                "version": b.version,
                "error": b.error,
            }
            for b in registry.broken
        ],
        "incompatible": [
            {"plugin": name, "distribution": dist, "version": version, "reason": reason}
            for name, (dist, version, reason) in registry.incompatible_plugins.items()
        ],
        "conflicts": {
            name: [f"{s.plugin} ({s.distribution})" for s in specs]
            for name, specs in conflicts.items()
        },
    }


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cmd_backends(args: argparse.Namespace) -> int:
    registry = default_registry()
    payload = _backends_payload(registry)
    if args.json:
        print(json.dumps(payload, indent=2))
        return 0
    rows = [["NAME", "ALIASES", "DISTRIBUTION", "VERSION", "CAPABILITIES", "DESCRIPTION"]]
    for spec in registry.backends():
        if spec.incompatible:
            caps = "INCOMPATIBLE"
        elif spec.name in payload["conflicts"]:
            caps = "CONFLICT"
        else:
            caps = spec.capabilities.describe()
        aliases = ",".join(spec.aliases) or "-"
        where = spec.distribution or spec.plugin
        rows.append([spec.name, aliases, where, spec.version or "-", caps, spec.description])
    if len(rows) > 1:
        print(_table(rows))
    else:
        print("No backends installed. Install one: pip install executor-plugin-uniproc")
    for name, claimants in payload["conflicts"].items():
        print(f"\nconflict: backend name {name!r} is claimed by {', '.join(claimants)}")
    problems = plugin_problems(registry)
    if problems:
        print("\n" + "\n".join(problems))
    known = {n for spec in registry.backends() for n in (spec.name, *spec.aliases)}
    not_installed = _not_installed(IN_TREE_BACKENDS, known)
    if not_installed:
        print("\nAlso available:")
        for line in not_installed:
            print(f"  {line}")
    return 0


def build_parser(registry: Registry | None = None) -> argparse.ArgumentParser:
    """The argument parser of the ``executor`` command, with the subcommands of the plugins
    in ``registry`` (none without one)."""
    return _build_parser(registry)[0]


def _build_parser(
    registry: Registry | None,
) -> tuple[argparse.ArgumentParser, argparse._SubParsersAction[Any]]:
    parser = argparse.ArgumentParser(
        prog="executor",
        description="Executor SDK: run a model's workers on any backend.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action="store_true", help="show the core's and each plugin's version"
    )
    sub = parser.add_subparsers(dest="command")
    backends = sub.add_parser("backends", help="list the installed backends (like 'pip list')")
    backends.add_argument("--json", action="store_true", help="machine-readable output")
    backends.set_defaults(func=_cmd_backends)
    if registry is not None:
        _add_plugin_commands(registry, sub)
    not_installed = _not_installed(IN_TREE_COMMANDS, sub.choices)
    if not_installed:
        parser.epilog = "also available (not installed):\n" + "\n".join(
            f"  {line}" for line in not_installed
        )
    return parser, sub


def _add_plugin_commands(registry: Registry, sub: argparse._SubParsersAction[Any]) -> None:
    """Let every installed plugin add its subcommands (``executor_register_commands``)."""
    try:
        registry.hook.executor_register_commands(commands=sub)
    except argparse.ArgumentError as exc:  # a plugin reused a name
        raise SystemExit(f"executor: a plugin's command clashes with another: {exc}") from None


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv``: its first argument that is not an option (the
    ``executor`` command's own options take no value)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def _unknown_command_message(name: str, registry: Registry) -> str:
    """Why the in-tree command ``name`` is missing, and how to get it."""
    dist = IN_TREE_COMMANDS[name]
    lines = [f"unknown command {name!r}."]
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        lines.append(f"The {name!r} command is provided by {dist}: pip install {dist}")
    else:
        lines.append(
            f"The {name!r} command is provided by {dist}, installed ({version}) but its "
            "plugin is not loaded."
        )
        lines.extend(registry.diagnostics())
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``executor`` console script."""
    registry = default_registry()
    parser, commands = _build_parser(registry)
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command(argv)
    if command in IN_TREE_COMMANDS and command not in commands.choices:
        parser.error(_unknown_command_message(command, registry))
    args = parser.parse_args(argv)
    if args.version:
        for dist, version in _versions(registry).items():
            print(f"{dist} {version}")
        for line in plugin_problems(registry):
            print(line)
        return 0
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
