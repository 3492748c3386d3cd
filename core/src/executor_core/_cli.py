"""The ``executor`` command: list backends, show versions, run the main job."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ._main_job import add_run_arguments, run_main_job
from ._registry import IN_TREE_BACKENDS, Registry, default_registry
from ._version import __version__

__all__ = ["build_parser", "main"]


def _versions(registry: Registry) -> dict[str, str]:
    versions = {"executor-core": __version__}
    for _name, (dist, version) in sorted(registry.plugins.items()):
        if dist:
            versions[dist] = version
    return versions


def _plugin_problems(registry: Registry) -> list[str]:
    """One entry per broken or incompatible plugin (``--version`` prints them after the
    versions, so a bug report shows them too)."""
    lines = [
        f"broken plugin {b.name} ({b.distribution or '?'} {b.version or '?'}): {b.error}"
        for b in registry.broken
    ]
    lines.extend(
        f"incompatible plugin {name} ({dist or '?'} {version or '?'}): {reason}"
        for name, (dist, version, reason) in registry.incompatible_plugins.items()
    )
    return [line.replace("\n", "\n    ") for line in lines]


def _backends_payload(registry: Registry) -> dict[str, Any]:
    conflicts = registry.conflicts()
    return {
        "backends": [
            {
                "name": spec.name,
                "aliases": list(spec.aliases),
                "plugin": spec.plugin,
                "distribution": spec.distribution,
                "version": spec.version,
                "executor": spec.executor,
                "description": spec.description,
                "capabilities": {
                    "pipeline_parallel": spec.capabilities.pipeline_parallel,
                    "multi_node": spec.capabilities.multi_node,
                    "devices": list(spec.capabilities.devices),
                    "max_world_size": spec.capabilities.max_world_size,
                },
                "requires": list(spec.requires),
                "conflict": spec.name in conflicts,
                "incompatible": spec.incompatible,
            }
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
    # The payload lists the registry's backends in order: read capabilities off the specs.
    for spec, b in zip(registry.backends(), payload["backends"], strict=True):
        if b["incompatible"]:
            caps = "INCOMPATIBLE"
        elif b["conflict"]:
            caps = "CONFLICT"
        else:
            caps = spec.capabilities.describe()
        rows.append(
            [
                b["name"],
                ",".join(b["aliases"]) or "-",
                b["distribution"] or b["plugin"],
                b["version"] or "-",
                caps,
                b["description"],
            ]
        )
    if len(rows) > 1:
        print(_table(rows))
    else:
        print("No backends installed. Install one: pip install executor-plugin-uniproc")
    for name, claimants in payload["conflicts"].items():
        print(f"\nconflict: backend name {name!r} is claimed by {', '.join(claimants)}")
    if payload["broken"]:
        print("\nPlugins that failed to load:")
        for b in payload["broken"]:
            error = b["error"].replace("\n", "\n      ")
            print(f"  {b['plugin']} ({b['distribution'] or '?'} {b['version']}): {error}")
    if payload["incompatible"]:
        print("\nPlugins built for another executor-core (not used; upgrade or reinstall them):")
        for p in payload["incompatible"]:
            print(f"  {p['plugin']} ({p['distribution'] or '?'} {p['version']}): {p['reason']}")
    known = {n for b in payload["backends"] for n in (b["name"], *b["aliases"])}
    not_installed: dict[str, str] = {}
    for name, dist in IN_TREE_BACKENDS.items():
        if name not in known:
            not_installed.setdefault(dist, name)
    if not_installed:
        print("\nAlso available:")
        for dist, name in sorted(not_installed.items()):
            print(f"  {name}: pip install {dist}")
    return 0


def build_parser(registry: Registry | None = None) -> argparse.ArgumentParser:
    """The argument parser of the ``executor`` command, with the subcommands of the plugins
    in ``registry`` (none without one)."""
    parser = argparse.ArgumentParser(
        prog="executor", description="Executor SDK: run a model's workers on any backend."
    )
    parser.add_argument(
        "--version", action="store_true", help="show the core's and each plugin's version"
    )
    sub = parser.add_subparsers(dest="command")
    backends = sub.add_parser("backends", help="list the installed backends (like 'pip list')")
    backends.add_argument("--json", action="store_true", help="machine-readable output")
    backends.set_defaults(func=_cmd_backends)
    run = sub.add_parser("run", help="run the main job: the reference model on a backend")
    add_run_arguments(run)
    run.set_defaults(func=run_main_job)
    if registry is not None:
        _add_plugin_commands(registry, sub)
    return parser


def _add_plugin_commands(registry: Registry, sub: argparse._SubParsersAction[Any]) -> None:
    """Let every installed plugin add its subcommands (``executor_register_commands``)."""
    try:
        registry.hook.executor_register_commands(commands=sub)
    except argparse.ArgumentError as exc:  # a plugin reused a name
        raise SystemExit(f"executor: a plugin's command clashes with another: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``executor`` console script."""
    parser = build_parser(default_registry())
    args = parser.parse_args(argv)
    if args.version:
        registry = default_registry()
        for dist, version in _versions(registry).items():
            print(f"{dist} {version}")
        for line in _plugin_problems(registry):
            print(line)
        return 0
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
