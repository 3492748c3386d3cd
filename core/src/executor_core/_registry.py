"""The backend registry: plugins found through entry points, backends resolved by name.

A plugin is a module named by an entry point in the ``executor.plugins`` group. Importing it
must be cheap: it only declares hook implementations. A backend's executor class is named by
a qualname and imported only when that backend is chosen.
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
    """What a backend can do, shown by ``executor backends`` and used for selection."""

    #: Runs pipeline-parallel stages.
    pipeline_parallel: bool = False
    #: Spans several nodes.
    multi_node: bool = False
    #: Device types it can drive.
    devices: tuple[str, ...] = ("cpu",)

    def describe(self) -> str:
        """A short human-readable summary, e.g. ``"pp, multi-node, cpu/cuda"``."""
        parts = []
        if self.pipeline_parallel:
            parts.append("pp")
        if self.multi_node:
            parts.append("multi-node")
        parts.append("/".join(self.devices))
        return ", ".join(parts)


def _tuple_of_str(value: Iterable[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    return tuple(value)


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
    #: Distributions the backend needs installed (checked when it is chosen).
    requires: tuple[str, ...] = attrs.field(default=(), converter=_tuple_of_str)
    #: Filled in by the registry: the plugin (entry-point) name, distribution and version.
    plugin: str = ""
    distribution: str = ""
    version: str = ""


@attrs.frozen(kw_only=True)
class BrokenPlugin:
    """A plugin that failed to load or to register; it is skipped, and shown to the user."""

    name: str
    distribution: str
    version: str
    error: str
    traceback: str = ""


@attrs.define
class _PluginInfo:
    name: str
    distribution: str
    version: str


class Registry:
    """Plugins and the backends they declare. Create one per use (tests) or use
    :func:`default_registry` (cached per process)."""

    def __init__(self) -> None:
        self.plugin_manager = pluggy.PluginManager(_hookspecs.PROJECT_NAME)
        self.plugin_manager.add_hookspecs(_hookspecs)
        self.plugin_manager.register(_selection, name="executor_core.builtin_selection")
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
        A plugin that fails to import or to validate is recorded in :attr:`broken`.
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
            try:
                plugin = ep.load()
            except Exception as exc:  # noqa: BLE001 - a broken plugin is recorded, not fatal
                self._record_broken(ep.name, dist, version, exc)
                continue
            self.register_plugin(plugin, ep.name, distribution=dist, version=version)

    def register_plugin(
        self, plugin: ModuleType | object, name: str, *, distribution: str = "", version: str = ""
    ) -> bool:
        """Register a plugin object or module directly (tests, embedded use).

        Its hook implementations are validated against the specs; a plugin that fails
        validation is recorded in :attr:`broken` and False is returned.
        """
        if name in self._plugins:
            self._record_broken(
                name,
                distribution,
                version,
                ValueError(f"a plugin named {name!r} is already registered"),
            )
            return False
        try:
            self.plugin_manager.register(plugin, name=name)
            self.plugin_manager.check_pending()
        except Exception as exc:  # noqa: BLE001 - validation errors are recorded for the user
            if self.plugin_manager.is_registered(plugin):
                self.plugin_manager.unregister(plugin)
            self._record_broken(name, distribution, version, exc)
            return False
        self._plugins[name] = _PluginInfo(name, distribution, version)
        self._backends = None
        return True

    def _record_broken(self, name: str, dist: str, version: str, exc: BaseException) -> None:
        self._broken.append(
            BrokenPlugin(
                name=name,
                distribution=dist,
                version=version,
                error=f"{type(exc).__name__}: {exc}",
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
        """Loaded plugin names mapped to ``(distribution, version)``."""
        return {name: (p.distribution, p.version) for name, p in self._plugins.items()}

    def backends(self) -> list[BackendSpec]:
        """Every declared backend, in plugin registration order (conflicting ones included)."""
        if self._backends is None:
            self._backends = self._collect_backends()
        return list(self._backends)

    def _collect_backends(self) -> list[BackendSpec]:
        found: list[BackendSpec] = []
        hook = self.plugin_manager.hook.executor_register_backends
        # Each plugin's impl is called on its own so that one raising does not hide the others.
        already_broken = {b.name for b in self._broken}
        for impl in hook.get_hookimpls():  # registration order
            info = self._plugins.get(impl.plugin_name)
            if info is None or info.name in already_broken:
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
                self._record_broken(info.name, info.distribution, info.version, exc)
                continue
            found.extend(
                attrs.evolve(
                    spec, plugin=info.name, distribution=info.distribution, version=info.version
                )
                for spec in specs
            )
        return found

    def _claims(self) -> dict[str, list[BackendSpec]]:
        claims: dict[str, list[BackendSpec]] = {}
        for spec in self.backends():
            for key in (spec.name, *spec.aliases):
                claims.setdefault(key, []).append(spec)
        return claims

    def conflicts(self) -> dict[str, list[BackendSpec]]:
        """Names (or aliases) claimed by more than one backend."""
        return {name: specs for name, specs in self._claims().items() if len(specs) > 1}

    def names(self) -> list[str]:
        """The names of the backends that can be resolved (no conflict)."""
        conflicts = self.conflicts()
        return [spec.name for spec in self.backends() if spec.name not in conflicts]

    def get(self, name: str) -> BackendSpec:
        """The backend called ``name`` (or with that alias).

        Raises :class:`UnknownBackendError` (listing what is available, the broken plugins and
        an install hint) or :class:`BackendConflictError`.
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
        raise UnknownBackendError(self._unknown_message(name))

    def _unknown_message(self, name: str) -> str:
        lines = [f"unknown executor backend {name!r}."]
        available = sorted(
            {n for s in self.backends() for n in (s.name, *s.aliases)} - set(self.conflicts())
        )
        lines.append(f"Available backends: {', '.join(available) if available else 'none'}.")
        if name in IN_TREE_BACKENDS:
            lines.append(
                f"The {name!r} backend is provided by {IN_TREE_BACKENDS[name]}: "
                f"pip install {IN_TREE_BACKENDS[name]}"
            )
        broken = self._broken
        if broken:
            lines.append("Plugins that failed to load:")
            lines.extend(f"  {b.name} ({b.distribution or '?'}): {b.error}" for b in broken)
        if os.environ.get(PLUGINS_ENV_VAR) is not None:
            lines.append(f"{PLUGINS_ENV_VAR}={os.environ[PLUGINS_ENV_VAR]!r} restricts loading.")
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
            raise UnknownBackendError(
                f"no installed backend can run world_size={config.world_size} on "
                f"num_nodes={config.num_nodes} with backend='auto'. "
                + self._unknown_message("auto").split("\n", 1)[1]
                + "\nInstall executor-plugin-multiproc (one node) or executor-plugin-ray "
                "(several nodes)."
            )
        return self.get(chosen).name

    def executor_class(self, name: str) -> type[Executor]:
        """Import and return the executor class of backend ``name`` (an alias works too)."""
        from ._executor import Executor

        spec = self.get(name)
        missing = [req for req in spec.requires if not _is_installed(req)]
        if missing:
            raise BackendLoadError(
                f"backend {spec.name!r} needs {', '.join(missing)} installed: "
                f"pip install {' '.join(missing)}"
            )
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


def _is_installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@functools.cache
def default_registry() -> Registry:
    """The process's registry, loaded from entry points on first use and then cached.

    ``default_registry.cache_clear()`` drops it (tests do, to get a fresh one).
    """
    return Registry.from_entry_points()
