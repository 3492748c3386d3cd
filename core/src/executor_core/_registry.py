"""The backend registry: plugins found through entry points, backends resolved by name.

A plugin is a module named by an entry point in the ``executor.plugins`` group. Importing it
must be cheap: it only declares hook implementations. A backend's executor class is named by
a qualname and imported only when that backend is chosen.

Registration is strict, as pluggy's: :meth:`Registry.register_plugin` raises
:class:`PluginRegistrationError` and registers nothing when a plugin is bad or its name is
taken. Loading entry points is the one place that records a broken plugin
(:attr:`Registry.broken`) and goes on, so that one broken distribution never hides the others.

A plugin whose distribution requires an ``executor-core`` version other than the installed one
is *incompatible*: its backends are listed (so the user sees why) but never run, its other
hooks never run, and choosing one of its backends raises :class:`BackendLoadError`.

The messages are written by ``_registry_messages``; the version checks are ``_requirements``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import traceback
from collections.abc import Iterable
from types import ModuleType
from typing import TYPE_CHECKING, Any

import attrs
import pluggy

from . import _hookspecs, _selection
from . import _registry_messages as messages
from ._errors import BackendConflictError, BackendLoadError, ExecutorError, UnknownBackendError
from ._qualname import resolve_qualname
from ._requirements import Incompatibility, check_core_requirement, core_requirement, unmet
from ._specs import ENTRY_POINT_GROUP, PLUGINS_ENV_VAR, BackendSpec, BrokenPlugin, Capabilities

if TYPE_CHECKING:
    from ._config import ExecutorConfig
    from ._executor import Executor

__all__ = [
    "ENTRY_POINT_GROUP",
    "PLUGINS_ENV_VAR",
    "BackendSpec",
    "BrokenPlugin",
    "Capabilities",
    "PluginRegistrationError",
    "Registry",
    "default_registry",
]


class PluginRegistrationError(ExecutorError, ValueError):
    """A plugin cannot be registered: its name is taken, a hook implementation does not match
    its spec, it implements no hook, or its ``executor_register_backends`` raised or returned
    something other than :class:`BackendSpec` objects. Nothing of it stays registered."""

    def __init__(self, plugin_name: str, reason: str) -> None:
        super().__init__(plugin_name, reason)
        #: The name it was to be registered under (the entry-point name when loaded).
        self.plugin_name = plugin_name
        #: What is wrong, and what to do, without the plugin's name.
        self.reason = reason

    def __str__(self) -> str:
        return f"cannot register plugin {self.plugin_name!r}: {self.reason}"


class _Refused(Exception):
    """Internal: why a plugin that pluggy accepted is refused all the same."""


@attrs.frozen
class _Plugin:
    name: str
    distribution: str
    version: str
    incompatibility: Incompatibility | None
    #: Its pluggy manager: the registry's, or the one of incompatible plugins.
    manager: pluggy.PluginManager = attrs.field(eq=False)
    #: What its executor_register_backends declared, filled in with the plugin's details.
    specs: tuple[BackendSpec, ...] = ()


def _manager() -> pluggy.PluginManager:
    manager = pluggy.PluginManager(_hookspecs.PROJECT_NAME)
    manager.add_hookspecs(_hookspecs)
    return manager


def _declared_backends(manager: pluggy.PluginManager, plugin: object) -> list[BackendSpec]:
    """What ``plugin``'s ``executor_register_backends`` returns (``[]`` without one).

    Raises :class:`_Refused` when it raises or returns anything but BackendSpec objects.
    """
    impls = manager.hook.executor_register_backends.get_hookimpls()
    impl = next((impl for impl in impls if impl.plugin is plugin), None)
    if impl is None:
        return []
    try:
        declared: Any = impl.function()
        specs = list(declared)
    except Exception as exc:  # the plugin's own code: it is refused, and says why
        raise _Refused(f"executor_register_backends raised {type(exc).__name__}: {exc}") from exc
    for spec in specs:
        if not isinstance(spec, BackendSpec):
            raise _Refused(
                "executor_register_backends must return BackendSpec objects, "
                f"got {type(spec).__name__}"
            )
    return specs


class Registry:
    """Plugins and the backends they declare. Create one per use (tests) or use
    :func:`default_registry` (cached per process)."""

    def __init__(self) -> None:
        self.plugin_manager = _manager()
        self.plugin_manager.register(_selection, name="executor_core.builtin_selection")
        # Incompatible plugins live in a manager of their own: their backends can be listed,
        # but none of their hooks reaches :attr:`hook` (selection, worker hooks).
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
        """Import and register every plugin in ``group``.

        ``allow`` (default: the ``EXECUTOR_PLUGINS`` environment variable, comma-separated)
        restricts which entry-point names load; ``None`` and an unset variable load all.
        A plugin that fails to import or to register is recorded in :attr:`broken` and the
        others still load; one whose distribution requires another executor-core version is
        registered as incompatible.
        """
        if allow is None and (env := os.environ.get(PLUGINS_ENV_VAR)) is not None:
            allow = [name.strip() for name in env.split(",") if name.strip()]
        allowed = None if allow is None else set(allow)
        for ep in importlib.metadata.entry_points(group=group):
            if allowed is not None and ep.name not in allowed:
                continue
            dist, version = (ep.dist.name, ep.dist.version) if ep.dist is not None else ("", "")
            requirement = core_requirement(ep.dist)
            try:
                plugin = ep.load()
            except Exception as exc:  # noqa: BLE001 - a broken plugin is recorded, not fatal
                # A plugin built for another core often fails to import it: say so.
                why = check_core_requirement(requirement)
                note = "" if why is None else f" ({why.describe()})"
                self._record_broken(
                    ep.name, dist, version, f"{type(exc).__name__}: {exc}{note}", exc
                )
                continue
            try:
                self.register_plugin(
                    plugin,
                    ep.name,
                    distribution=dist,
                    version=version,
                    core_requirement=requirement,
                )
            except PluginRegistrationError as exc:
                self._record_broken(ep.name, dist, version, exc.reason, exc)

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
        ``name``.

        Strict, as pluggy's ``register``: raises :class:`PluginRegistrationError`, with
        nothing registered, when ``name`` (or the object) is already registered, a hook
        implementation does not match its spec (an unknown hook or argument), the plugin
        implements no hook at all, or its ``executor_register_backends`` (called here, once)
        raises or returns anything but :class:`BackendSpec` objects.

        ``core_requirement`` is what the plugin requires of executor-core (PEP 508, e.g.
        ``"executor-core>=0.1,<0.2"``; :meth:`load_entry_points` reads it from the
        distribution's metadata): when the installed core does not satisfy it the plugin is
        registered as incompatible (see :attr:`incompatible_plugins`), not refused.
        """
        for taken in (self.plugin_manager, self._incompatible_manager):
            if taken.has_plugin(name) or taken.is_registered(plugin):
                reason = messages.already_registered(name, taken.get_name(plugin))
                raise PluginRegistrationError(name, reason)
        why = check_core_requirement(core_requirement)
        manager = self.plugin_manager if why is None else self._incompatible_manager
        try:
            manager.register(plugin, name=name)
            manager.check_pending()
            if not manager.get_hookcallers(plugin):
                raise _Refused(messages.no_hookimpl(plugin))
            specs = _declared_backends(manager, plugin)
        except Exception as exc:  # noqa: BLE001 - any failure refuses the plugin, and says why
            if manager.is_registered(plugin):
                manager.unregister(plugin)
            refused = isinstance(exc, _Refused)
            reason = str(exc) if refused else f"{type(exc).__name__}: {exc}"
            note = "" if why is None else f" ({why.describe()})"
            raise PluginRegistrationError(name, reason + note) from (
                exc.__cause__ if refused else exc
            )
        incompatible = "" if why is None else why.describe()
        filled = tuple(
            attrs.evolve(
                spec,
                plugin=name,
                distribution=distribution,
                version=version,
                incompatible=incompatible,
            )
            for spec in specs
        )
        self._plugins.pop(name, None)  # one unregistered from plugin_manager directly
        self._plugins[name] = _Plugin(name, distribution, version, why, manager, filled)
        return name

    def _record_broken(
        self, name: str, dist: str, version: str, error: str, exc: BaseException
    ) -> None:
        self._broken.append(
            BrokenPlugin(
                name=name,
                distribution=dist,
                version=version,
                error=error,
                traceback="".join(traceback.format_exception(exc)),
            )
        )

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
            p.name: (p.distribution, p.version, p.incompatibility.describe())
            for p in self._registered()
            if p.incompatibility is not None
        }

    def backends(self) -> list[BackendSpec]:
        """Every declared backend, in plugin registration order (conflicting and incompatible
        ones included: see :attr:`BackendSpec.incompatible`)."""
        return [spec for plugin in self._registered() for spec in plugin.specs]

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
        claims = self._claims()
        specs = claims.get(name, [])
        if len(specs) == 1:
            return specs[0]
        if specs:
            raise BackendConflictError(messages.backend_conflict(name, specs))
        incompatible = self._claims(incompatible=True).get(name)
        if incompatible:
            plugin = self._plugins[incompatible[0].plugin]
            assert plugin.incompatibility is not None  # only incompatible specs come here
            raise BackendLoadError(
                messages.backend_incompatible(
                    incompatible[0],
                    messages.plugin_label(plugin.name, plugin.distribution, plugin.version),
                    plugin.incompatibility,
                )
            )
        available = sorted(n for n, claimants in claims.items() if len(claimants) == 1)
        raise UnknownBackendError(messages.unknown_backend(name, available, self))

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
            installed = [self.get(name) for name in names]
            raise UnknownBackendError(messages.auto_not_found(config, installed, self))
        return self.get(chosen).name

    def executor_class(self, name: str) -> type[Executor]:
        """Import and return the executor class of backend ``name`` (an alias works too).

        Raises :class:`BackendLoadError` when a requirement in :attr:`BackendSpec.requires` is
        missing or of the wrong version (with a ``pip install`` line that pastes into a shell),
        or when the class cannot be imported or is not an Executor.
        """
        from ._executor import Executor

        spec = self.get(name)
        problems = [(req, problem) for req, problem in map(unmet, spec.requires) if problem]
        if problems:
            raise BackendLoadError(messages.backend_requirements_unmet(spec, problems))
        try:
            cls: Any = resolve_qualname(spec.executor)
        except ImportError as exc:
            raise BackendLoadError(messages.backend_import_failed(spec, exc)) from exc
        if not (isinstance(cls, type) and issubclass(cls, Executor)):
            raise BackendLoadError(messages.backend_not_an_executor(spec))
        return cls


@functools.cache
def default_registry() -> Registry:
    """The process's registry, loaded from entry points on first use and then cached.

    ``default_registry.cache_clear()`` drops it (tests do, to get a fresh one).
    """
    return Registry.from_entry_points()
