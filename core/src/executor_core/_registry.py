"""The backend registry: plugins found through entry points, backends resolved by name.

A plugin is a module named by an entry point in the ``executor.plugins`` group. Importing it
must be cheap: it only declares hook implementations. A backend's executor class is named by
a qualname and imported only when that backend is chosen.

A plugin whose distribution requires an ``executor-core`` version other than the installed one
is *incompatible*: its backends are listed (so the user sees why) but never run, its other
hooks never run, and choosing one of its backends raises :class:`BackendLoadError`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import shlex
import traceback
from collections.abc import Iterable
from types import ModuleType
from typing import TYPE_CHECKING, Any

import attrs
import pluggy
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from . import _hookspecs, _selection
from ._errors import BackendConflictError, BackendLoadError, UnknownBackendError
from ._qualname import resolve_qualname

if TYPE_CHECKING:
    from ._config import ExecutorConfig
    from ._executor import Executor

__all__ = [
    "ENTRY_POINT_GROUP",
    "IN_TREE_BACKENDS",
    "PLUGINS_ENV_VAR",
    "BackendSpec",
    "BrokenPlugin",
    "Capabilities",
    "Registry",
    "default_registry",
]

#: The entry-point group plugins register under (``<project>.<kind>``).
ENTRY_POINT_GROUP = "executor.plugins"

#: Comma-separated allow-list of plugin (entry-point) names to load; unset loads all.
PLUGINS_ENV_VAR = "EXECUTOR_PLUGINS"

#: Backends this repository ships, by name, with the distribution that provides each
#: (used for the install hint when one is asked for but not installed).
IN_TREE_BACKENDS: dict[str, str] = {
    "uni": "executor-plugin-uniproc",
    "external_launcher": "executor-plugin-uniproc",
    "mp": "executor-plugin-multiproc",
    "multiproc": "executor-plugin-multiproc",
    "ray": "executor-plugin-ray",
}


@attrs.frozen(kw_only=True)
class Capabilities:
    """What a backend can do: shown by ``executor backends``, enforced by the core when an
    executor is created (a config asking for more is refused before anything starts), and
    checked against behaviour by the conformance kit."""

    #: Runs pipeline-parallel stages.
    pipeline_parallel: bool = False
    #: Spans several nodes.
    multi_node: bool = False
    #: Device types it can drive.
    devices: tuple[str, ...] = ("cpu",)
    #: The most workers it can run (``None``: no limit).
    max_world_size: int | None = None

    def describe(self) -> str:
        """A short human-readable summary, e.g. ``"pp, multi-node, cpu/cuda"``."""
        parts = []
        if self.pipeline_parallel:
            parts.append("pp")
        if self.multi_node:
            parts.append("multi-node")
        parts.append("/".join(self.devices))
        if self.max_world_size is not None:
            parts.append(f"max {self.max_world_size} worker(s)")
        return ", ".join(parts)


def _tuple_of_str(value: Iterable[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    return tuple(value)


def _check_requirements(_instance: object, _attribute: object, value: tuple[str, ...]) -> None:
    for item in value:
        try:
            Requirement(item)
        except InvalidRequirement as exc:
            raise ValueError(
                f"BackendSpec.requires: {item!r} is not a PEP 508 requirement "
                f"(e.g. 'ray>=2.10'): {exc}"
            ) from exc


@attrs.frozen(kw_only=True)
class BackendSpec:
    """A backend a plugin declares from ``executor_register_backends``."""

    #: The name users pass as ``ExecutorConfig.backend``.
    name: str = attrs.field(validator=attrs.validators.min_len(1))
    #: ``"package.module:Class"`` of the Executor subclass; imported only when chosen.
    executor: str = attrs.field(validator=attrs.validators.matches_re(r"^[\w.]+:[\w.]+$"))
    #: One line shown by ``executor backends``.
    description: str = ""
    #: Other names that resolve to this backend.
    aliases: tuple[str, ...] = attrs.field(default=(), converter=_tuple_of_str)
    capabilities: Capabilities = attrs.field(factory=Capabilities)
    #: PEP 508 requirements the backend needs installed, e.g. ``"ray>=2.10"`` (checked when it
    #: is chosen: name and version; a marker that does not apply here skips the requirement;
    #: extras are named in the install hint but not checked).
    requires: tuple[str, ...] = attrs.field(
        default=(), converter=_tuple_of_str, validator=_check_requirements
    )
    #: Filled in by the registry: the plugin (entry-point) name, distribution and version.
    plugin: str = ""
    distribution: str = ""
    version: str = ""
    #: Filled in by the registry: why the plugin cannot run with the installed executor-core,
    #: e.g. ``"requires executor-core>=0.2,<0.3; installed 0.1.0"``; empty when it can.
    incompatible: str = ""


@attrs.frozen(kw_only=True)
class BrokenPlugin:
    """A plugin that failed to load or to register; it is skipped, and shown to the user."""

    name: str
    distribution: str
    version: str
    error: str
    traceback: str = ""


def _core_version() -> str:
    """The installed executor-core version (the source tree's when it is not installed)."""
    try:
        return importlib.metadata.version("executor-core")
    except importlib.metadata.PackageNotFoundError:
        from ._version import __version__

        return __version__


def _core_requirement(dist: importlib.metadata.Distribution | None) -> str:
    """What ``dist`` requires of executor-core here, e.g. ``"executor-core>=0.1,<0.2"``.

    Every requirement on executor-core whose marker applies is combined; ``""`` when there is
    none (or none with a version range).
    """
    specifier = SpecifierSet()
    for line in (dist.requires or []) if dist is not None else []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue  # not ours to judge; pip would have refused it
        if canonicalize_name(req.name) != "executor-core":
            continue
        # "extra" is empty: a requirement only an optional extra pulls in does not apply.
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        specifier &= req.specifier
    return f"executor-core{specifier}" if str(specifier) else ""


@attrs.frozen
class _Incompatibility:
    requirement: str  # "executor-core>=0.2,<0.3"
    installed: str

    def describe(self) -> str:
        return f"requires {self.requirement}; installed {self.installed}"


def _check_core_requirement(requirement: str) -> _Incompatibility | None:
    if not requirement:
        return None
    req = Requirement(requirement)
    installed = _core_version()
    # Pre-releases count: a development build of the core must not reject every plugin.
    if req.specifier.contains(installed, prereleases=True):
        return None
    return _Incompatibility(f"executor-core{req.specifier}", installed)


@attrs.define
class _PluginInfo:
    name: str
    distribution: str
    version: str
    incompatibility: _Incompatibility | None = None

    def label(self) -> str:
        return f"{self.name} ({self.distribution or '?'} {self.version or '?'})"


class Registry:
    """Plugins and the backends they declare. Create one per use (tests) or use
    :func:`default_registry` (cached per process)."""

    def __init__(self) -> None:
        self.plugin_manager = pluggy.PluginManager(_hookspecs.PROJECT_NAME)
        self.plugin_manager.add_hookspecs(_hookspecs)
        self.plugin_manager.register(_selection, name="executor_core.builtin_selection")
        # Incompatible plugins live in a manager of their own: their backends can be listed,
        # but none of their hooks reaches :attr:`hook` (selection, worker hooks).
        self._incompatible_manager = pluggy.PluginManager(_hookspecs.PROJECT_NAME)
        self._incompatible_manager.add_hookspecs(_hookspecs)
        self._plugins: dict[str, _PluginInfo] = {}
        self._broken: list[BrokenPlugin] = []
        self._backends: list[BackendSpec] | None = None

    @classmethod
    def from_entry_points(
        cls, group: str = ENTRY_POINT_GROUP, allow: Iterable[str] | None = None
    ) -> Registry:
        """A registry loaded from installed entry points (see :meth:`load_entry_points`)."""
        registry = cls()
        registry.load_entry_points(group, allow)
        return registry

    @property
    def hook(self) -> pluggy.HookRelay:
        """The hook relay (``registry.hook.executor_worker_ready(...)``)."""
        return self.plugin_manager.hook

    def load_entry_points(
        self, group: str = ENTRY_POINT_GROUP, allow: Iterable[str] | None = None
    ) -> None:
        """Import and register every plugin in ``group``.

        ``allow`` (default: the ``EXECUTOR_PLUGINS`` environment variable, comma-separated)
        restricts which entry-point names load; ``None`` and an unset variable load all.
        A plugin that fails to import or to validate is recorded in :attr:`broken`; one whose
        distribution requires another executor-core version is registered as incompatible.
        """
        if allow is None:
            env = os.environ.get(PLUGINS_ENV_VAR)
            if env is not None:
                allow = [name.strip() for name in env.split(",") if name.strip()]
        allowed = None if allow is None else set(allow)
        for ep in importlib.metadata.entry_points(group=group):
            if allowed is not None and ep.name not in allowed:
                continue
            dist = ep.dist.name if ep.dist is not None else ""
            version = ep.dist.version if ep.dist is not None else ""
            core_requirement = _core_requirement(ep.dist)
            try:
                plugin = ep.load()
            except Exception as exc:  # noqa: BLE001 - a broken plugin is recorded, not fatal
                incompatibility = _check_core_requirement(core_requirement)
                # A plugin built for another core often fails to import it: say so.
                note = "" if incompatibility is None else f" ({incompatibility.describe()})"
                self._record_broken(ep.name, dist, version, exc, note)
                continue
            self.register_plugin(
                plugin,
                ep.name,
                distribution=dist,
                version=version,
                core_requirement=core_requirement,
            )

    def register_plugin(
        self,
        plugin: ModuleType | object,
        name: str,
        *,
        distribution: str = "",
        version: str = "",
        core_requirement: str = "",
    ) -> bool:
        """Register a plugin object or module directly (tests, embedded use).

        Its hook implementations are validated against the specs; a plugin that fails
        validation, or implements no hook at all, is recorded in :attr:`broken` and False is
        returned. ``core_requirement`` is what the plugin requires of executor-core (PEP 508,
        e.g. ``"executor-core>=0.1,<0.2"``; :meth:`load_entry_points` reads it from the
        distribution's metadata): when the installed core does not satisfy it the plugin is
        registered as incompatible (see :attr:`incompatible_plugins`) and True is returned.
        """
        if name in self._plugins:
            self._record_broken(
                name,
                distribution,
                version,
                ValueError(f"a plugin named {name!r} is already registered"),
            )
            return False
        incompatibility = _check_core_requirement(core_requirement)
        manager = self.plugin_manager if incompatibility is None else self._incompatible_manager
        try:
            manager.register(plugin, name=name)
            manager.check_pending()
            if not manager.get_hookcallers(plugin):
                raise pluggy.PluginValidationError(plugin, _no_hookimpl_message(plugin))
        except Exception as exc:  # noqa: BLE001 - validation errors are recorded for the user
            if manager.is_registered(plugin):
                manager.unregister(plugin)
            note = "" if incompatibility is None else f" ({incompatibility.describe()})"
            self._record_broken(name, distribution, version, exc, note)
            return False
        self._plugins[name] = _PluginInfo(name, distribution, version, incompatibility)
        self._backends = None
        return True

    def _record_broken(
        self, name: str, dist: str, version: str, exc: BaseException, note: str = ""
    ) -> None:
        self._broken.append(
            BrokenPlugin(
                name=name,
                distribution=dist,
                version=version,
                error=f"{type(exc).__name__}: {exc}{note}",
                traceback="".join(traceback.format_exception(exc)),
            )
        )

    @property
    def broken(self) -> list[BrokenPlugin]:
        """Plugins that failed to load or register, with their errors."""
        self.backends()  # collecting backends can find more broken plugins
        return list(self._broken)

    @property
    def plugins(self) -> dict[str, tuple[str, str]]:
        """Loaded, compatible plugin names mapped to ``(distribution, version)``."""
        return {
            name: (p.distribution, p.version)
            for name, p in self._plugins.items()
            if p.incompatibility is None
        }

    @property
    def incompatible_plugins(self) -> dict[str, tuple[str, str, str]]:
        """Plugins that need another executor-core, mapped to ``(distribution, version,
        reason)``; the reason reads ``"requires executor-core>=0.2; installed 0.1.0"``."""
        return {
            name: (p.distribution, p.version, p.incompatibility.describe())
            for name, p in self._plugins.items()
            if p.incompatibility is not None
        }

    def backends(self) -> list[BackendSpec]:
        """Every declared backend, in plugin registration order (conflicting and incompatible
        ones included: see :attr:`BackendSpec.incompatible`)."""
        if self._backends is None:
            self._backends = self._collect_backends()
        return list(self._backends)

    def _collect_backends(self) -> list[BackendSpec]:
        impls = {
            impl.plugin_name: impl
            for manager in (self.plugin_manager, self._incompatible_manager)
            for impl in manager.hook.executor_register_backends.get_hookimpls()
        }
        found: list[BackendSpec] = []
        # Each plugin's impl is called on its own so that one raising does not hide the others.
        already_broken = {b.name for b in self._broken}
        for info in self._plugins.values():  # registration order
            impl = impls.get(info.name)
            if impl is None or info.name in already_broken:
                continue
            try:
                declared: Any = impl.function()
                specs = list(declared)
                for spec in specs:
                    if not isinstance(spec, BackendSpec):
                        raise TypeError(
                            f"executor_register_backends must return BackendSpec objects, "
                            f"got {type(spec).__name__}"
                        )
            except Exception as exc:  # noqa: BLE001 - recorded as a broken plugin
                note = (
                    "" if info.incompatibility is None else f" ({info.incompatibility.describe()})"
                )
                self._record_broken(info.name, info.distribution, info.version, exc, note)
                continue
            incompatible = "" if info.incompatibility is None else info.incompatibility.describe()
            found.extend(
                attrs.evolve(
                    spec,
                    plugin=info.name,
                    distribution=info.distribution,
                    version=info.version,
                    incompatible=incompatible,
                )
                for spec in specs
            )
        return found

    def _claims(self, *, incompatible: bool = False) -> dict[str, list[BackendSpec]]:
        # Incompatible backends claim no name: they can never run, so they neither conflict
        # with a working backend nor shadow one.
        claims: dict[str, list[BackendSpec]] = {}
        for spec in self.backends():
            if bool(spec.incompatible) == incompatible:
                for key in (spec.name, *spec.aliases):
                    claims.setdefault(key, []).append(spec)
        return claims

    def conflicts(self) -> dict[str, list[BackendSpec]]:
        """Names (or aliases) claimed by more than one compatible backend."""
        return {name: specs for name, specs in self._claims().items() if len(specs) > 1}

    def names(self) -> list[str]:
        """The names of the backends that can be resolved (compatible, no conflict)."""
        conflicts = self.conflicts()
        return [
            spec.name
            for spec in self.backends()
            if not spec.incompatible and spec.name not in conflicts
        ]

    def get(self, name: str) -> BackendSpec:
        """The backend called ``name`` (or with that alias).

        Raises :class:`UnknownBackendError` (listing what is available, the broken plugins and
        an install hint), :class:`BackendConflictError`, or :class:`BackendLoadError` when the
        backend's plugin needs another executor-core version.
        """
        specs = self._claims().get(name, [])
        if len(specs) == 1:
            return specs[0]
        if len(specs) > 1:
            claimants = ", ".join(
                f"{s.name!r} from plugin {s.plugin!r} ({s.distribution or 'not installed'})"
                for s in specs
            )
            raise BackendConflictError(
                f"backend name {name!r} is claimed by several plugins: {claimants}. "
                f"Uninstall one, or restrict loading with {PLUGINS_ENV_VAR}=<plugin names>, "
                "or pass the executor class as 'package.module:Class'."
            )
        incompatible = self._claims(incompatible=True).get(name, [])
        if incompatible:
            raise BackendLoadError(self._incompatible_message(incompatible[0]))
        raise UnknownBackendError(self._unknown_message(name))

    def _incompatible_message(self, spec: BackendSpec) -> str:
        info = self._plugins[spec.plugin]
        assert info.incompatibility is not None  # only incompatible specs come here
        requirement, installed = info.incompatibility.requirement, info.incompatibility.installed
        message = (
            f"backend {spec.name!r} cannot be used: its plugin {info.label()} requires "
            f"{requirement}, but executor-core {installed} is installed. Install the "
            f"executor-core it needs: pip install {shlex.quote(requirement)}"
        )
        if spec.distribution:
            # pip's resolver then picks the newest release of the plugin that fits this core.
            pin = shlex.quote(f"executor-core=={installed}")
            message += (
                f", or a version of {spec.distribution} made for executor-core {installed}: "
                f"pip install {shlex.quote(spec.distribution)} {pin}"
            )
        return message

    def _diagnostics(self) -> list[str]:
        """Lines on what else may explain a missing backend: broken, incompatible, allow-list."""
        lines = []
        if self._broken:
            lines.append("Plugins that failed to load:")
            lines.extend(f"  {b.name} ({b.distribution or '?'}): {b.error}" for b in self._broken)
        incompatible = [p for p in self._plugins.values() if p.incompatibility is not None]
        if incompatible:
            lines.append("Plugins built for another executor-core (not used):")
            lines.extend(
                f"  {p.label()}: {p.incompatibility.describe()}"
                for p in incompatible
                if p.incompatibility is not None
            )
        if os.environ.get(PLUGINS_ENV_VAR) is not None:
            lines.append(f"{PLUGINS_ENV_VAR}={os.environ[PLUGINS_ENV_VAR]!r} restricts loading.")
        return lines

    def _unknown_message(self, name: str) -> str:
        lines = [f"unknown executor backend {name!r}."]
        available = sorted(self._claims().keys() - self.conflicts().keys())
        lines.append(f"Available backends: {', '.join(available) if available else 'none'}.")
        if name in IN_TREE_BACKENDS:
            lines.append(
                f"The {name!r} backend is provided by {IN_TREE_BACKENDS[name]}: "
                f"pip install {IN_TREE_BACKENDS[name]}"
            )
        lines.extend(self._diagnostics())
        return "\n".join(lines)

    def resolve_name(self, config: ExecutorConfig) -> str:
        """The backend name for ``config`` (``"auto"`` asks the selection hook)."""
        backend = config.backend
        if not isinstance(backend, str):
            raise TypeError("resolve_name takes a config whose backend is a name")
        if backend != "auto":
            return self.get(backend).name
        chosen = self.hook.executor_select_backend(config=config, available=self.names())
        if chosen is None:
            raise UnknownBackendError(self._auto_message(config))
        return self.get(chosen).name

    def _auto_message(self, config: ExecutorConfig) -> str:
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
        installed = self.names()
        suitable = [
            name for name in installed if not multi_node or self.get(name).capabilities.multi_node
        ]
        if suitable:
            lines.append(
                f"Installed: {', '.join(installed)}; pass backend={suitable[0]!r} "
                + ("(or another of them) " if len(suitable) > 1 else "")
                + "to use it."
            )
        elif installed:
            lines.append(
                f"Installed: {', '.join(installed)}"
                + ("; none declares multi-node support." if multi_node else ".")
            )
        else:
            lines.append("Installed: none.")
        lines.append(f"Or install {dist}: pip install {dist}")
        lines.extend(self._diagnostics())
        return "\n".join(lines)

    def executor_class(self, name: str) -> type[Executor]:
        """Import and return the executor class of backend ``name`` (an alias works too).

        Raises :class:`BackendLoadError` when a requirement in :attr:`BackendSpec.requires` is
        missing or of the wrong version (with a ``pip install`` line that pastes into a shell),
        or when the class cannot be imported or is not an Executor.
        """
        from ._executor import Executor

        spec = self.get(name)
        unmet = [(req, problem) for req, problem in map(_unmet, spec.requires) if problem]
        if unmet:
            needs = ", ".join(f"{req} ({problem})" for req, problem in unmet)
            command = " ".join(shlex.quote(req) for req, _ in unmet)
            raise BackendLoadError(f"backend {spec.name!r} needs {needs}: pip install {command}")
        try:
            cls: Any = resolve_qualname(spec.executor)
        except ImportError as exc:
            raise BackendLoadError(
                f"backend {spec.name!r} from {spec.distribution or spec.plugin!r} failed to "
                f"import {spec.executor!r}: {exc}"
            ) from exc
        if not (isinstance(cls, type) and issubclass(cls, Executor)):
            raise BackendLoadError(
                f"backend {spec.name!r}: {spec.executor!r} is not an Executor subclass"
            )
        return cls


def _unmet(requirement: str) -> tuple[str, str]:
    """``(requirement to install, what is wrong)``; what is wrong is ``""`` when it is met.

    The requirement to install drops the marker: it applies here, and pip takes the rest.
    """
    req = Requirement(requirement)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        return requirement, ""
    req.marker = None
    try:
        installed = importlib.metadata.version(req.name)
    except importlib.metadata.PackageNotFoundError:
        return str(req), "not installed"
    if req.specifier.contains(installed, prereleases=True):
        return str(req), ""
    return str(req), f"{installed} installed"


def _no_hookimpl_message(plugin: object) -> str:
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


@functools.cache
def default_registry() -> Registry:
    """The process's registry, loaded from entry points on first use and then cached.

    ``default_registry.cache_clear()`` drops it (tests do, to get a fresh one).
    """
    return Registry.from_entry_points()
