"""The registry's words: why a plugin cannot be registered, why a backend cannot be found or
used, and what to install or change. Every message says what was wrong and what to do.

The registry decides; this module only writes. It reads a :class:`Registry` through its public
properties, so the ``executor`` command shows the same lines as the errors.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ._specs import PLUGINS_ENV_VAR, BackendSpec

if TYPE_CHECKING:
    from ._config import ExecutorConfig
    from ._registry import Registry
    from ._requirements import Incompatibility

__all__ = [
    "IN_TREE_BACKENDS",
    "already_registered",
    "auto_not_found",
    "backend_conflict",
    "backend_import_failed",
    "backend_incompatible",
    "backend_not_an_executor",
    "backend_requirements_unmet",
    "diagnostics",
    "no_hookimpl",
    "plugin_label",
    "plugin_problems",
    "unknown_backend",
]

#: Backends this repository ships, by name, with the distribution that provides each
#: (used for the install hint when one is asked for but not installed).
IN_TREE_BACKENDS: dict[str, str] = {
    "uni": "executor-plugin-uniproc",
    "external_launcher": "executor-plugin-uniproc",
    "mp": "executor-plugin-multiproc",
    "multiproc": "executor-plugin-multiproc",
    "ray": "executor-plugin-ray",
}


# --- registering a plugin ------------------------------------------------------------------


def already_registered(name: str, registered_as: str | None) -> str:
    """Why a plugin cannot be registered as ``name``: the name is taken, or (with
    ``registered_as``) the same object is already registered under that name."""
    if registered_as is not None:
        return f"this plugin object is already registered, as {registered_as!r}"
    return (
        f"the name {name!r} is taken by another plugin: register this one under another name, "
        "or unregister the other first"
    )


def no_hookimpl(plugin: object) -> str:
    """Why ``plugin`` is refused when it implements no hook at all."""
    # pluggy registers a module with no @hookimpl function without complaint; without this
    # check a forgotten decorator would make the plugin's backends silently disappear.
    undecorated = sorted(
        n for n in dir(plugin) if n.startswith("executor_") and callable(getattr(plugin, n, None))
    )
    if undecorated:
        return (
            "registers no hook implementation: did you forget @hookimpl on "
            f"{', '.join(undecorated)}? (from executor_core import hookimpl)"
        )
    return (
        "registers no hook implementation: no function is decorated with "
        "@executor_core.hookimpl (a backend plugin defines executor_register_backends)"
    )


# --- the plugins that are not used ---------------------------------------------------------


def plugin_label(name: str, distribution: str, version: str) -> str:
    """``"name (distribution version)"``, with ``?`` for what is not known."""
    return f"{name} ({distribution or '?'} {version or '?'})"


def plugin_problems(registry: Registry) -> list[str]:
    """Headed, indented lines on the plugins that failed to load and those built for another
    executor-core; ``[]`` when there are none. ``executor backends`` and ``--version`` print
    them; the errors of a missing backend include them."""
    lines = []
    if registry.broken:
        lines.append("Plugins that failed to load:")
        lines.extend(
            f"  {plugin_label(b.name, b.distribution, b.version)}: "
            + b.error.replace("\n", "\n      ")
            for b in registry.broken
        )
    if registry.incompatible_plugins:
        lines.append(
            "Plugins built for another executor-core (not used; upgrade or reinstall them):"
        )
        lines.extend(
            f"  {plugin_label(name, dist, version)}: {reason}"
            for name, (dist, version, reason) in registry.incompatible_plugins.items()
        )
    return lines


def diagnostics(registry: Registry) -> list[str]:
    """What else may explain a missing backend or command: :func:`plugin_problems`, and the
    allow-list when it is set."""
    lines = plugin_problems(registry)
    allow = os.environ.get(PLUGINS_ENV_VAR)
    if allow is not None:
        lines.append(f"{PLUGINS_ENV_VAR}={allow!r} restricts loading.")
    return lines


# --- finding a backend ---------------------------------------------------------------------


def backend_conflict(name: str, specs: Sequence[BackendSpec]) -> str:
    """Why ``name``, claimed by each of ``specs``, resolves to none of them."""
    claimants = ", ".join(
        f"{s.name!r} from plugin {s.plugin!r} ({s.distribution or 'not installed'})" for s in specs
    )
    return (
        f"backend name {name!r} is claimed by several plugins: {claimants}. "
        f"Uninstall one, or restrict loading with {PLUGINS_ENV_VAR}=<plugin names>, "
        "or pass the executor class as 'package.module:Class'."
    )


def backend_incompatible(spec: BackendSpec, plugin: str, why: Incompatibility) -> str:
    """Why ``spec``, from ``plugin`` (its label) built for another executor-core, cannot run."""
    message = (
        f"backend {spec.name!r} cannot be used: its plugin {plugin} requires "
        f"{why.requirement}, but executor-core {why.installed} is installed. Install the "
        f"executor-core it needs: pip install {shlex.quote(why.requirement)}"
    )
    if spec.distribution:
        # pip's resolver then picks the newest release of the plugin that fits this core.
        pin = shlex.quote(f"executor-core=={why.installed}")
        message += (
            f", or a version of {spec.distribution} made for executor-core {why.installed}: "
            f"pip install {shlex.quote(spec.distribution)} {pin}"
        )
    return message


def unknown_backend(name: str, available: Sequence[str], registry: Registry) -> str:
    """Why no backend is called ``name``: what is available, how to install an in-tree
    backend, and the :func:`diagnostics`."""
    lines = [
        f"unknown executor backend {name!r}.",
        f"Available backends: {', '.join(available) if available else 'none'}.",
    ]
    if name in IN_TREE_BACKENDS:
        dist = IN_TREE_BACKENDS[name]
        lines.append(f"The {name!r} backend is provided by {dist}: pip install {dist}")
    lines.extend(diagnostics(registry))
    return "\n".join(lines)


def auto_not_found(
    config: ExecutorConfig, installed: Sequence[BackendSpec], registry: Registry
) -> str:
    """Why ``backend="auto"`` chose nothing for ``config`` among the ``installed`` backends."""
    # Mirrors the built-in rule in _selection: auto never picks a third-party backend by
    # itself (only a plugin's executor_select_backend hook can), so name the ones installed.
    multi_node = config.num_nodes > 1
    if multi_node:
        needed, dist = "'ray'", IN_TREE_BACKENDS["ray"]
    elif config.world_size == 1:
        needed, dist = "'uni' or 'mp'", IN_TREE_BACKENDS["uni"]
    else:
        needed, dist = "'mp'", IN_TREE_BACKENDS["mp"]
    lines = [
        f"backend='auto' found no backend for world_size={config.world_size} on "
        f"num_nodes={config.num_nodes}: it picks only from the built-in backends uni/mp/ray "
        f"(here {needed}, not installed), unless a plugin's executor_select_backend hook "
        "chooses another."
    ]
    names = ", ".join(spec.name for spec in installed)
    suitable = [s.name for s in installed if not multi_node or s.capabilities.multi_node]
    if suitable:
        others = "(or another of them) " if len(suitable) > 1 else ""
        lines.append(f"Installed: {names}; pass backend={suitable[0]!r} {others}to use it.")
    elif installed:
        lines.append(
            f"Installed: {names}" + ("; none declares multi-node support." if multi_node else ".")
        )
    else:
        lines.append("Installed: none.")
    lines.append(f"Or install {dist}: pip install {dist}")
    lines.extend(diagnostics(registry))
    return "\n".join(lines)


# --- loading a backend's executor class ----------------------------------------------------


def backend_requirements_unmet(spec: BackendSpec, unmet: Sequence[tuple[str, str]]) -> str:
    """Why ``spec`` cannot load: each ``(requirement, problem)``, and one ``pip install`` line
    that pastes into a shell."""
    needs = ", ".join(f"{req} ({problem})" for req, problem in unmet)
    command = " ".join(shlex.quote(req) for req, _ in unmet)
    return f"backend {spec.name!r} needs {needs}: pip install {command}"


def backend_import_failed(spec: BackendSpec, exc: ImportError) -> str:
    """Why ``spec``'s executor class could not be imported."""
    return (
        f"backend {spec.name!r} from {spec.distribution or spec.plugin!r} failed to import "
        f"{spec.executor!r}: {exc}"
    )


def backend_not_an_executor(spec: BackendSpec) -> str:
    """Why ``spec``'s executor, once imported, is refused."""
    return (
        f"backend {spec.name!r}: {spec.executor!r} is not an Executor subclass; a backend "
        "names its Executor subclass as 'package.module:Class' (see docs/writing-a-backend.md)"
    )
