"""The backend registry: plugins found through entry points, backends resolved by name.

A plugin is a module named by an entry point in the ``executor.plugins`` group. Importing it
must be cheap: it only declares hook implementations; a backend's executor class is named by
a qualname and imported only when that backend is chosen. Registration is strict, as
pluggy's: :meth:`Registry.register_plugin` raises :class:`PluginRegistrationError` and
registers nothing when a plugin is bad or its name is taken. Loading entry points is the one
place that records a broken plugin (:attr:`Registry.broken`) and goes on. A plugin whose
distribution requires another ``executor-core`` version is *incompatible*: its backends are
listed but never run, and its other hooks never run. Every message says what was wrong and
what to do; the ``executor`` command shows the same lines as the errors.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import shlex
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import attrs
import pluggy
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from . import _hooks
from ._errors import BackendConflictError, BackendLoadError, ExecutorError, UnknownBackendError

if TYPE_CHECKING:
    from ._config import ExecutorConfig

__all__ = [
    "ENTRY_POINT_GROUP",
    "PLUGINS_ENV_VAR",
    "BackendSpec",
    "BrokenPlugin",
    "Capabilities",
    "PluginRegistrationError",
    "Registry",
    "default_registry",
    "lazy_getattr",
    "plugin_problems",
    "resolve_qualname",
]

#: The entry-point group plugins register under.
ENTRY_POINT_GROUP = "executor.plugins"
#: Comma-separated allow-list of plugin (entry-point) names to load; unset loads all.
PLUGINS_ENV_VAR = "EXECUTOR_PLUGINS"
#: What ``Capabilities.recovery`` may say.
RECOVERY_KINDS: tuple[str, ...] = ("none", "restart", "replace")
#: Backends this repository ships, with their distribution (the install hint of a missing one).
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
    executor is created, and checked against behaviour by the conformance kit."""

    #: Runs pipeline-parallel stages.
    pipeline_parallel: bool = False
    #: Spans several nodes.
    multi_node: bool = False
    #: Device types it can drive.
    devices: tuple[str, ...] = ("cpu",)
    #: The most workers it can run (``None``: no limit).
    max_world_size: int | None = None
    #: How it comes back when workers die: ``"none"`` (a config with a recovery policy is
    #: refused), ``"restart"`` (every rank started again: a group restart), ``"replace"``
    #: (only the dead ranks get new processes; the survivors keep theirs and rejoin through
    #: ``WorkerBase.rejoin``; a group restart where that fails).
    recovery: str = attrs.field(default="none", validator=attrs.validators.in_(RECOVERY_KINDS))
    #: Its transport answers ``Transport.probe`` and ``Transport.kill``, so that
    #: ``ExecutorConfig.hang_timeout_s`` can declare a hung rank dead.
    liveness_probe: bool = False

    def describe(self) -> str:
        """A short human-readable summary, e.g. ``"pp, multi-node, cpu/cuda"``."""
        parts = ["pp"] if self.pipeline_parallel else []
        parts += ["multi-node"] if self.multi_node else []
        parts.append("/".join(self.devices))
        if self.max_world_size is not None:
            parts.append(f"max {self.max_world_size} worker(s)")
        if self.recovery != "none":
            parts.append(f"recovery: {self.recovery}")
        return ", ".join(parts + (["hang probe"] if self.liveness_probe else []))


def _strings(value: str | Iterable[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


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
    aliases: tuple[str, ...] = attrs.field(default=(), converter=_strings)
    capabilities: Capabilities = attrs.field(factory=Capabilities)
    #: PEP 508 requirements the backend needs installed, e.g. ``"ray>=2.10"`` (checked when it
    #: is chosen; a marker that does not apply here skips the requirement).
    requires: tuple[str, ...] = attrs.field(
        default=(), converter=_strings, validator=_check_requirements
    )
    #: Filled in by the registry: the plugin (entry-point) name, distribution and version,
    #: and why the plugin cannot run with the installed executor-core ("" when it can).
    plugin: str = ""
    distribution: str = ""
    version: str = ""
    incompatible: str = ""


@attrs.frozen(kw_only=True)
class BrokenPlugin:
    """A plugin found through an entry point that failed to import or to register: it is
    skipped, and listed by ``executor backends`` and in the errors of a missing backend."""

    #: The entry-point name, its distribution and version.
    name: str
    distribution: str
    version: str
    #: What went wrong, e.g. ``"ModuleNotFoundError: No module named 'x'"``, and its traceback.
    error: str
    traceback: str = ""


class PluginRegistrationError(ExecutorError, ValueError):
    """A plugin cannot be registered: its name is taken, a hook implementation does not match
    its spec, it implements no hook, or its ``executor_register_backends`` raised or returned
    something other than :class:`BackendSpec` objects. Nothing of it stays registered."""

    def __init__(self, plugin_name: str, reason: str) -> None:
        super().__init__(plugin_name, reason)
        #: The name it was to be registered under, and what is wrong (without the name).
        self.plugin_name, self.reason = plugin_name, reason

    def __str__(self) -> str:
        return f"cannot register plugin {self.plugin_name!r}: {self.reason}"


# --- versions ------------------------------------------------------------------------------


def _applies(req: Requirement) -> bool:
    return req.marker is None or req.marker.evaluate({"extra": ""})


def _core_requirement(dist: importlib.metadata.Distribution | None) -> str:
    """What ``dist`` requires of executor-core here (the requirements that apply,
    combined), e.g. ``"executor-core>=0.1,<0.2"``; "" when nothing."""
    specifier = SpecifierSet()
    for line in (dist.requires or []) if dist is not None else []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue  # not ours to judge; pip would have refused it
        if canonicalize_name(req.name) == "executor-core" and _applies(req):
            specifier &= req.specifier
    return f"executor-core{specifier}" if str(specifier) else ""


def _incompatibility(requirement: str) -> tuple[str, str] | None:
    """None when the installed executor-core meets ``requirement`` (pre-releases do), else
    ``(the requirement, the installed version)``."""
    if not requirement:
        return None
    try:
        installed = importlib.metadata.version("executor-core")
    except importlib.metadata.PackageNotFoundError:
        from ._version import __version__ as installed
    specifier = Requirement(requirement).specifier
    if specifier.contains(installed, prereleases=True):
        return None
    return f"executor-core{specifier}", installed


def _describe(why: tuple[str, str] | None) -> str:
    """``"requires executor-core>=0.2; installed 0.1.0"``, or "" for None."""
    return "" if why is None else f"requires {why[0]}; installed {why[1]}"


def _unmet(requirement: str) -> tuple[str, str]:
    """``(requirement to install, what is wrong)``; what is wrong is "" when it is met."""
    req = Requirement(requirement)
    if not _applies(req):
        return requirement, ""
    req.marker = None
    try:
        installed = importlib.metadata.version(req.name)
    except importlib.metadata.PackageNotFoundError:
        return str(req), "not installed"
    return str(req), "" if req.specifier.contains(
        installed, prereleases=True
    ) else f"{installed} installed"


# --- the registry --------------------------------------------------------------------------


@attrs.frozen
class _Plugin:
    name: str
    distribution: str
    version: str
    #: ``(requirement, installed version)`` when it cannot run with this executor-core.
    incompatibility: tuple[str, str] | None
    #: Its pluggy manager: the registry's, or the one of incompatible plugins.
    manager: pluggy.PluginManager = attrs.field(eq=False)
    #: What its executor_register_backends declared, filled in with the plugin's details.
    specs: tuple[BackendSpec, ...] = ()


def _manager() -> pluggy.PluginManager:
    manager = pluggy.PluginManager(_hooks.PROJECT_NAME)
    manager.add_hookspecs(_hooks)
    return manager


def _label(name: str, distribution: str, version: str) -> str:
    return f"{name} ({distribution or '?'} {version or '?'})"


class Registry:
    """Plugins and the backends they declare. Create one per use (tests) or use
    :func:`default_registry` (cached per process)."""

    def __init__(self) -> None:
        self.plugin_manager = _manager()
        self.plugin_manager.register(_Selection(), name="executor_core.builtin_selection")
        # Incompatible plugins live in a manager of their own: their backends can be listed,
        # but none of their hooks reaches :attr:`hook`.
        self._incompatible_manager = _manager()
        self._plugins: dict[str, _Plugin] = {}
        self._broken: list[BrokenPlugin] = []

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
        """Import and register every plugin in ``group``. ``allow`` (default: the
        ``EXECUTOR_PLUGINS`` environment variable, comma-separated) restricts which entry-point
        names load. A plugin that fails to import or to register is recorded in
        :attr:`broken` and the others still load; one that requires another executor-core
        version is registered as incompatible."""
        if allow is None and (env := os.environ.get(PLUGINS_ENV_VAR)) is not None:
            allow = [name.strip() for name in env.split(",") if name.strip()]
        allowed = None if allow is None else set(allow)
        for ep in importlib.metadata.entry_points(group=group):
            if allowed is not None and ep.name not in allowed:
                continue
            dist, version = (ep.dist.name, ep.dist.version) if ep.dist is not None else ("", "")
            requirement = _core_requirement(ep.dist)
            try:
                plugin = ep.load()
                self.register_plugin(
                    plugin,
                    ep.name,
                    distribution=dist,
                    version=version,
                    core_requirement=requirement,
                )
            except Exception as exc:  # noqa: BLE001 - a broken plugin is recorded, not fatal
                if isinstance(exc, PluginRegistrationError):
                    error = exc.reason
                else:  # a plugin built for another core often fails to import it: say so
                    why = _describe(_incompatibility(requirement))
                    error = f"{type(exc).__name__}: {exc}" + (f" ({why})" if why else "")
                trace = "".join(traceback.format_exception(exc))
                self._broken.append(
                    BrokenPlugin(
                        name=ep.name,
                        distribution=dist,
                        version=version,
                        error=error,
                        traceback=trace,
                    )
                )

    def register_plugin(
        self,
        plugin: ModuleType | object,
        name: str,
        *,
        distribution: str = "",
        version: str = "",
        core_requirement: str = "",
    ) -> str:
        """Register a plugin object or module directly (embedded engines, tests); returns
        ``name``. Strict, as pluggy's ``register``: raises :class:`PluginRegistrationError`,
        with nothing registered, when ``name`` (or the object) is already registered, a hook
        implementation does not match its spec, the plugin implements no hook, or its
        ``executor_register_backends`` (called here, once) raises or returns anything but
        :class:`BackendSpec` objects. ``core_requirement`` is what it requires of
        executor-core (PEP 508): when the installed core does not meet it the plugin is
        registered as incompatible (:attr:`incompatible_plugins`), not refused."""
        for taken in (self.plugin_manager, self._incompatible_manager):
            if taken.has_plugin(name) or taken.is_registered(plugin):
                registered_as = taken.get_name(plugin)
                reason = (
                    f"this plugin object is already registered, as {registered_as!r}"
                    if registered_as is not None
                    else f"the name {name!r} is taken by another plugin: register this one "
                    "under another name, or unregister the other first"
                )
                raise PluginRegistrationError(name, reason)
        incompatibility = _incompatibility(core_requirement)
        why = _describe(incompatibility)
        manager = self._incompatible_manager if why else self.plugin_manager
        try:
            manager.register(plugin, name=name)
            manager.check_pending()
            if not manager.get_hookcallers(plugin):
                raise _Refused(_no_hookimpl(plugin))
            specs = _declared_backends(manager, plugin)
        except Exception as exc:  # noqa: BLE001 - any failure refuses the plugin, and says why
            if manager.is_registered(plugin):
                manager.unregister(plugin)
            refused = isinstance(exc, _Refused)
            reason = (str(exc) if refused else f"{type(exc).__name__}: {exc}") + (
                f" ({why})" if why else ""
            )
            raise PluginRegistrationError(name, reason) from (exc.__cause__ if refused else exc)
        filled = tuple(
            attrs.evolve(
                s, plugin=name, distribution=distribution, version=version, incompatible=why
            )
            for s in specs
        )
        self._plugins.pop(name, None)  # one unregistered from plugin_manager directly
        self._plugins[name] = _Plugin(name, distribution, version, incompatibility, manager, filled)
        return name

    def _registered(self) -> list[_Plugin]:
        """The plugins registered, in order (one unregistered from pluggy directly is gone)."""
        return [p for p in self._plugins.values() if p.manager.has_plugin(p.name)]

    @property
    def broken(self) -> list[BrokenPlugin]:
        """The entry points that failed to import or to register, with their errors."""
        return list(self._broken)

    @property
    def plugins(self) -> dict[str, tuple[str, str]]:
        """Loaded, compatible plugin names mapped to ``(distribution, version)``."""
        return {
            p.name: (p.distribution, p.version)
            for p in self._registered()
            if p.incompatibility is None
        }

    @property
    def incompatible_plugins(self) -> dict[str, tuple[str, str, str]]:
        """Plugins that need another executor-core, mapped to ``(distribution, version,
        reason)``; the reason reads ``"requires executor-core>=0.2; installed 0.1.0"``."""
        return {
            p.name: (p.distribution, p.version, _describe(p.incompatibility))
            for p in self._registered()
            if p.incompatibility is not None
        }

    def backends(self) -> list[BackendSpec]:
        """Every declared backend, in plugin registration order (conflicting and incompatible
        ones included: see :attr:`BackendSpec.incompatible`)."""
        return [spec for plugin in self._registered() for spec in plugin.specs]

    def _claims(self, *, incompatible: bool = False) -> dict[str, list[BackendSpec]]:
        # Incompatible backends claim no name: they never run, so they neither conflict with
        # a working backend nor shadow one.
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
        return [s.name for s in self.backends() if not s.incompatible and s.name not in conflicts]

    def get(self, name: str) -> BackendSpec:
        """The backend called ``name`` (or with that alias). Raises
        :class:`UnknownBackendError` (listing what is available, the broken plugins and an
        install hint), :class:`BackendConflictError`, or :class:`BackendLoadError` when the
        backend's plugin needs another executor-core version."""
        claims = self._claims()
        specs = claims.get(name, [])
        if len(specs) == 1:
            return specs[0]
        if specs:
            claimants = ", ".join(
                f"{s.name!r} from plugin {s.plugin!r} ({s.distribution or 'not installed'})"
                for s in specs
            )
            raise BackendConflictError(
                f"backend name {name!r} is claimed by several plugins: {claimants}. Uninstall "
                f"one, or restrict loading with {PLUGINS_ENV_VAR}=<plugin names>, or pass the "
                "executor class as 'package.module:Class'."
            )
        incompatible = self._claims(incompatible=True).get(name)
        if incompatible:
            raise BackendLoadError(self._incompatible(incompatible[0]))
        available = sorted(n for n, claimants in claims.items() if len(claimants) == 1)
        lines = [
            f"unknown executor backend {name!r}.",
            f"Available backends: {', '.join(available) if available else 'none'}.",
        ]
        if name in IN_TREE_BACKENDS:
            dist = IN_TREE_BACKENDS[name]
            lines.append(f"The {name!r} backend is provided by {dist}: pip install {dist}")
        raise UnknownBackendError("\n".join(lines + self.diagnostics()))

    def _incompatible(self, spec: BackendSpec) -> str:
        plugin = self._plugins[spec.plugin]
        assert plugin.incompatibility is not None  # only incompatible specs come here
        requirement, installed = plugin.incompatibility
        message = (
            f"backend {spec.name!r} cannot be used: its plugin "
            f"{_label(plugin.name, plugin.distribution, plugin.version)} requires {requirement}, "
            f"but executor-core {installed} is installed. Install the executor-core it needs: "
            f"pip install {shlex.quote(requirement)}"
        )
        if spec.distribution:  # pip then picks the newest release of the plugin for this core
            pin = shlex.quote(f"executor-core=={installed}")
            message += (
                f", or a version of {spec.distribution} made for executor-core {installed}: "
                f"pip install {shlex.quote(spec.distribution)} {pin}"
            )
        return message

    def resolve_name(self, config: ExecutorConfig) -> str:
        """The backend name for ``config`` (``"auto"`` asks the selection hook)."""
        backend = config.backend
        if not isinstance(backend, str):
            raise TypeError("resolve_name takes a config whose backend is a name")
        if backend != "auto":
            return self.get(backend).name
        names = self.names()
        chosen = self.hook.executor_select_backend(config=config, available=names)
        if chosen is None:
            raise UnknownBackendError(self._auto_not_found(config, [self.get(n) for n in names]))
        return self.get(chosen).name

    def _auto_not_found(self, config: ExecutorConfig, installed: Sequence[BackendSpec]) -> str:
        # Mirrors the built-in rule (_Selection): auto never picks a third-party backend by
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
            none = "; none declares multi-node support." if multi_node else "."
            lines.append(f"Installed: {names}{none}")
        else:
            lines.append("Installed: none.")
        lines.append(f"Or install {dist}: pip install {dist}")
        return "\n".join(lines + self.diagnostics())

    def load_executor(self, name: str) -> Any:
        """Import the executor class of backend ``name`` (an alias works too). Raises
        :class:`BackendLoadError` when a requirement in :attr:`BackendSpec.requires` is
        missing or of the wrong version (with a ``pip install`` line that pastes into a
        shell), or when the class cannot be imported. ``Executor.get_class`` checks it is an
        Executor."""
        spec = self.get(name)
        problems = [(req, problem) for req, problem in map(_unmet, spec.requires) if problem]
        if problems:
            needs = ", ".join(f"{req} ({problem})" for req, problem in problems)
            command = " ".join(shlex.quote(req) for req, _ in problems)
            raise BackendLoadError(f"backend {spec.name!r} needs {needs}: pip install {command}")
        try:
            return resolve_qualname(spec.executor)
        except ImportError as exc:
            raise BackendLoadError(
                f"backend {spec.name!r} from {spec.distribution or spec.plugin!r} failed to "
                f"import {spec.executor!r}: {exc}"
            ) from exc

    def diagnostics(self) -> list[str]:
        """What else may explain a missing backend or command: :func:`plugin_problems`, and
        the allow-list when it is set."""
        lines = plugin_problems(self)
        allow = os.environ.get(PLUGINS_ENV_VAR)
        return lines + (
            [f"{PLUGINS_ENV_VAR}={allow!r} restricts loading."] if allow is not None else []
        )


class _Refused(Exception):
    """Internal: why a plugin that pluggy accepted is refused all the same."""


def _declared_backends(manager: pluggy.PluginManager, plugin: object) -> list[BackendSpec]:
    """What ``plugin``'s ``executor_register_backends`` returns (``[]`` without one)."""
    impls = manager.hook.executor_register_backends.get_hookimpls()
    impl = next((impl for impl in impls if impl.plugin is plugin), None)
    if impl is None:
        return []
    try:
        declared: Any = impl.function()
        specs: list[Any] = list(declared)
    except Exception as exc:  # the plugin's own code: it is refused, and says why
        raise _Refused(f"executor_register_backends raised {type(exc).__name__}: {exc}") from exc
    for spec in specs:
        if not isinstance(spec, BackendSpec):
            raise _Refused(
                "executor_register_backends must return BackendSpec objects, "
                f"got {type(spec).__name__}"
            )
    return list(specs)


def _no_hookimpl(plugin: object) -> str:
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


def plugin_problems(registry: Registry) -> list[str]:
    """Headed, indented lines on the plugins that failed to load and those built for another
    executor-core; ``[]`` when there are none (``executor backends`` and the errors of a
    missing backend show them)."""
    lines = []
    if registry.broken:
        lines.append("Plugins that failed to load:")
        lines.extend(
            f"  {_label(b.name, b.distribution, b.version)}: " + b.error.replace("\n", "\n      ")
            for b in registry.broken
        )
    if registry.incompatible_plugins:
        lines.append(
            "Plugins built for another executor-core (not used; upgrade or reinstall them):"
        )
        lines.extend(
            f"  {_label(name, dist, version)}: {reason}"
            for name, (dist, version, reason) in registry.incompatible_plugins.items()
        )
    return lines


class _Selection:
    """The built-in rule for ``backend="auto"``, registered like any plugin and run last."""

    @_hooks.hookimpl(trylast=True)
    def executor_select_backend(
        self, config: ExecutorConfig, available: Sequence[str]
    ) -> str | None:
        """Several nodes or a live Ray session: ``ray``; one worker: ``uni``; else ``mp``."""
        ray = sys.modules.get("ray")  # never imported here
        ray_up = ray is not None and ray.is_initialized()
        if (config.num_nodes > 1 or ray_up) and "ray" in available:
            return "ray"
        if config.num_nodes > 1:
            return None  # only a multi-node backend will do; the caller explains what to install
        if config.world_size == 1 and "uni" in available:
            return "uni"
        return "mp" if "mp" in available else None


def resolve_qualname(qualname: str) -> Any:
    """Import ``"package.module:Attr.sub"`` and return the attribute; :class:`ImportError`
    names the module or attribute that could not be found."""
    module_name, sep, attr_path = qualname.partition(":")
    if not sep or not module_name or not attr_path:
        raise ImportError(
            f"{qualname!r} is not a qualified name; write it as 'package.module:ClassName'"
        )
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(
                f"module {module_name!r} has no attribute {attr_path!r} (from {qualname!r})"
            ) from None
    return obj


@functools.cache
def default_registry() -> Registry:
    """The process's registry, loaded from entry points on first use and then cached
    (``default_registry.cache_clear()`` drops it)."""
    return Registry.from_entry_points()


def lazy_getattr(package: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for a plugin ``package`` that imports ``name`` from the relative
    module ``table[name]`` on first use (a plugin's ``__init__`` is imported in every process
    that loads the registry, so it must not import its backend's code)."""

    def __getattr__(name: str) -> Any:
        where = table.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where, package), name)
        setattr(importlib.import_module(package), name, value)  # later lookups skip this
        return value

    return __getattr__
