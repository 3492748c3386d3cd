"""The sides of the benchmark: each installed backend, and each baseline, behind one shape.

A side is started by its :class:`SideSpec`, called with a method name and arguments (it
returns one reply per worker), and closed. Backends are listed by the executor_core registry
and run at their default options.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from executor_core.backend import BackendSpec

__all__ = [
    "ALL_ROWS",
    "BackendSide",
    "BenchUsageError",
    "Side",
    "SideSpec",
    "Skipped",
    "plugins_env",
    "select_backends",
]

Role = Literal["backend", "baseline", "workload"]
#: Every workload a side can take part in.
ALL_ROWS = frozenset({"hot", "cold", "payload", "startup"})

#: Backends that cannot be driven from this one process, and why (found by name: the
#: registry says what a backend can do, not how it is launched).
_NOT_STANDALONE = {
    "external_launcher": (
        "runs one rank in each process that torchrun starts (SPMD): there is no driver "
        "process to call its workers from"
    ),
}


class BenchUsageError(ValueError):
    """An option names something that does not exist here (``executor bench`` exits 2)."""


class Side(Protocol):
    """A started side: a backend's executor, or a baseline's processes."""

    def call(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        """Call ``method(*args)`` on every worker; return their replies, in rank order."""
        ...

    def close(self) -> None:
        """Stop the workers and release what the side holds."""
        ...


@dataclass(frozen=True)
class SideSpec:
    """A side as selected, not started yet."""

    #: The label in the results: a backend's name, or a baseline's (``Pipe``, ...).
    name: str
    role: Role
    workers: int
    #: How it runs, in words (``default options``; anything tuned says so here).
    note: str
    #: Starts the side (its start-up time is measured through this).
    start: Callable[[], Side] = field(compare=False, repr=False)
    #: Its workers busy-wait for a while after a call: other sides wait until that is over.
    spins: bool = False
    #: The workloads it takes part in.
    workloads: frozenset[str] = ALL_ROWS
    #: It runs on Ray: the run starts one Ray session first and shares it.
    needs_ray: bool = False
    #: A backend's plugin (entry-point name); empty for a baseline.
    plugin: str = ""
    #: What runs, with its version (``executor-plugin-multiproc 0.1.0``, ``ray 2.x``).
    version: str = ""


@dataclass(frozen=True)
class Skipped:
    """A side that is not measured, and why."""

    name: str
    role: Role
    reason: str


class BackendSide:
    """A backend's executor running :class:`~executor_bench._worker.BenchWorker`.

    ``options``: backend options (``None``: the defaults; a side that tunes one says so);
    ``config``: other :class:`~executor_core.ExecutorConfig` fields (``num_nodes``, ...).
    """

    def __init__(
        self,
        backend: str,
        workers: int,
        env: dict[str, str] | None = None,
        options: dict[str, Any] | None = None,
        **config: Any,
    ) -> None:
        from executor_core import ExecutorConfig, create_executor

        from ._worker import BenchWorker

        self.executor = create_executor(
            ExecutorConfig(
                worker_cls=BenchWorker,
                backend=backend,
                tensor_parallel_size=workers,
                env=env or {},
                backend_options=options or {},
                **config,
            )
        )

    def call(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        """``collective_rpc(method, args=args)``."""
        return self.executor.collective_rpc(method, args=args)

    def close(self) -> None:
        """Shut the executor down."""
        self.executor.shutdown()


def select_backends(
    requested: Sequence[str] | None, workers: int
) -> tuple[list[SideSpec], list[Skipped]]:
    """The backends to measure, and those skipped with the reason.

    ``requested`` holds names or aliases (``None``: every backend the registry lists). A
    backend that allows fewer workers than ``workers`` runs with as many as it allows.
    Raises :class:`BenchUsageError` for a name no installed plugin declares.
    """
    from executor_core.backend import default_registry

    registry = default_registry()
    specs = registry.backends()
    conflicts = registry.conflicts()
    by_name = {n: spec for spec in specs for n in (spec.name, *spec.aliases)}
    if requested is None:
        chosen = list({spec.name: spec for spec in specs}.values())  # a conflict: once
    else:
        unknown = [name for name in requested if name not in by_name]
        if unknown:
            known = ", ".join(spec.name for spec in specs) or "none"
            raise BenchUsageError(
                f"argument --backends: no installed backend is called "
                f"{', '.join(map(repr, unknown))}; installed: {known}"
            )
        chosen = list({by_name[name].name: by_name[name] for name in requested}.values())
    sides: list[SideSpec] = []
    skipped: list[Skipped] = []
    for spec in chosen:
        reason = _why_not(spec, spec.name in conflicts)
        if reason:
            skipped.append(Skipped(spec.name, "backend", reason))
            continue
        most = spec.capabilities.max_world_size
        count = workers if most is None else min(workers, most)
        note = "default options"
        if count < workers:
            note += f"; {count} worker{'s' if count > 1 else ''} (the most it runs)"
        sides.append(
            SideSpec(
                name=spec.name,
                role="backend",
                workers=count,
                note=note,
                start=_backend_starter(spec.name, count),
                needs_ray=any(_requirement_name(r) == "ray" for r in spec.requires),
                plugin=spec.plugin,
                version=f"{spec.distribution or spec.plugin} {spec.version}".strip(),
            )
        )
    return sides, skipped


def _why_not(spec: BackendSpec, conflict: bool) -> str:
    """Why ``spec`` cannot be measured here; empty if it can."""
    if spec.name in _NOT_STANDALONE:
        return _NOT_STANDALONE[spec.name]
    if spec.incompatible:
        return f"its plugin cannot run with this executor-core: {spec.incompatible}"
    if conflict:
        return "two plugins declare this name; `executor backends` shows them"
    if "cpu" not in spec.capabilities.devices:
        devices = ", ".join(spec.capabilities.devices)
        return f"drives {devices} only; the benchmark's workers run on the CPU"
    return ""


def _requirement_name(requirement: str) -> str:
    from packaging.requirements import Requirement

    return Requirement(requirement).name.lower()


def plugins_env() -> dict[str, str]:
    """The plugin allow-list this run set (or the user's), for a side's config's env: so it
    reaches every worker, Ray actors and node agents' included."""
    from executor_core.backend import PLUGINS_ENV_VAR

    allowed = os.environ.get(PLUGINS_ENV_VAR)
    return {} if allowed is None else {PLUGINS_ENV_VAR: allowed}


def _backend_starter(name: str, workers: int) -> Callable[[], Side]:
    def start() -> Side:
        return BackendSide(name, workers, plugins_env())

    return start
