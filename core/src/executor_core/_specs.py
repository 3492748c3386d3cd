"""The plugin contract's data: where plugins are found (:data:`ENTRY_POINT_GROUP`, the
:data:`PLUGINS_ENV_VAR` allow-list), what one declares (:class:`BackendSpec` with its
:class:`Capabilities`), and the record of one that failed to load (:class:`BrokenPlugin`)."""

from __future__ import annotations

from collections.abc import Iterable

import attrs
from packaging.requirements import InvalidRequirement, Requirement

__all__ = ["ENTRY_POINT_GROUP", "PLUGINS_ENV_VAR", "BackendSpec", "BrokenPlugin", "Capabilities"]

#: The entry-point group plugins register under (``<project>.<kind>``).
ENTRY_POINT_GROUP = "executor.plugins"

#: What ``Capabilities.recovery`` may say.
RECOVERY_KINDS: tuple[str, ...] = ("none", "restart", "replace")

#: Comma-separated allow-list of plugin (entry-point) names to load; unset loads all.
PLUGINS_ENV_VAR = "EXECUTOR_PLUGINS"


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
    #: How it comes back when workers die (``ExecutorConfig.recovery``): ``"none"`` (its
    #: workers cannot be started again in this process: a config with a recovery policy is
    #: refused), ``"restart"`` (every rank is stopped and started again, fresh contexts and a
    #: new ``torch.distributed`` rendezvous: a group restart), ``"replace"`` (only the dead
    #: ranks get new processes; the survivors keep theirs, with their memory, and rejoin
    #: through ``WorkerBase.rejoin``; a group restart where that fails: rank replacement).
    recovery: str = attrs.field(default="none", validator=attrs.validators.in_(RECOVERY_KINDS))

    #: Its transport answers :meth:`~executor_core.backend.Transport.probe` (is each rank's
    #: process alive and responsive?) and :meth:`~executor_core.backend.Transport.kill`, so
    #: that ``ExecutorConfig.hang_timeout_s`` can declare a hung rank dead.
    liveness_probe: bool = False

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
        if self.recovery != "none":
            parts.append(f"recovery: {self.recovery}")
        if self.liveness_probe:
            parts.append("hang probe")
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
    """A plugin found through an entry point that failed to import or to register: it is
    skipped, and listed by ``executor backends`` and in the errors of a missing backend."""

    #: The entry-point name.
    name: str
    distribution: str
    version: str
    #: What went wrong, e.g. ``"ModuleNotFoundError: No module named 'x'"``.
    error: str
    #: The full traceback of the failure.
    traceback: str = ""
