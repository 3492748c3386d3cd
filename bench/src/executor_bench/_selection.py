"""What a run's options select here, beyond its sides: the rows to time, the payload kinds
torch allows, the plugins to load."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence

from ._config import BenchConfig
from ._options import APART, NODES_SIZE, PAYLOAD_KINDS
from ._sides import BenchUsageError, SideSpec
from ._workloads import Row

__all__ = ["build_rows", "not_installed", "payload_kinds", "restrict_plugins"]


def build_rows(config: BenchConfig, kinds: Sequence[str]) -> list[Row]:
    rows: list[Row] = []
    for workload in config.workloads:
        if workload == "payload":
            rows += [Row("payload", kind, size) for kind in kinds for size in config.sizes]
        elif workload == "startup":
            rows += [Row("startup"), Row("shutdown")]
        elif workload in ("nodes", "slurm"):
            rows += [Row(workload), Row(workload, "bytes", NODES_SIZE)]
        elif workload in ("imports", "overhead", *APART):
            continue  # measured apart from the sides (_overhead, APART)
        else:
            rows.append(Row(workload))
    return rows


def restrict_plugins(sides: list[SideSpec], config: BenchConfig, facts: dict[str, str]) -> None:
    """Load only the measured backends' plugins (those of ``sides``; in this process and,
    through the config's env, in every worker): another installed plugin's hooks (an
    observer on every call) would be timed as part of every backend."""
    from executor_core.backend import PLUGINS_ENV_VAR, default_registry

    if PLUGINS_ENV_VAR in os.environ:
        facts["plugins"] = f"{PLUGINS_ENV_VAR}={os.environ[PLUGINS_ENV_VAR]} (as set)"
        return
    if config.all_plugins:
        facts["plugins"] = "every installed plugin (--all-plugins)"
        return
    names = sorted({side.plugin for side in sides if side.plugin})
    os.environ[PLUGINS_ENV_VAR] = ",".join(names)
    default_registry.cache_clear()
    facts["plugins"] = f"only the measured backends' ({', '.join(names) or 'none'})"


def payload_kinds(config: BenchConfig, notes: list[str]) -> list[str]:
    has_torch = importlib.util.find_spec("torch") is not None
    if config.kinds is not None:
        if "tensor" in config.kinds and not has_torch:
            raise BenchUsageError("argument --kinds: tensor needs torch, which is not installed")
        return list(config.kinds)
    if not has_torch:
        notes.append("tensor payloads skipped: torch is not installed")
        return ["bytes"]
    return list(PAYLOAD_KINDS)


def not_installed(*modules: str) -> str:
    """Which of ``modules`` cannot be imported here, in words; empty if all can."""
    absent = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except ImportError:  # a submodule of a missing package
            found = False
        if not found:
            absent.append(name)
    return f"{', '.join(absent)} not installed" if absent else ""
