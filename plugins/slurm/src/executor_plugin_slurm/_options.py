"""The ``backend_options`` the slurm backend understands: mp's, and how to ask Slurm for an
allocation and steps, validated into :class:`SlurmOptions`."""

from __future__ import annotations

import re
from typing import Any

import attrs

from executor_core.options import boolean, number, option, optional
from executor_plugin_multiproc import MultiprocOptions

__all__ = ["SlurmOptions"]


def _word(what: str) -> Any:
    """A non-empty string without spaces (a partition, an account, a host list)."""

    def check(value: Any) -> str:
        if not isinstance(value, str) or not value or any(c.isspace() for c in value):
            raise ValueError(f"must be {what}: a non-empty string without spaces")
        return value

    return check


def _count_or(pattern: str, says: str) -> Any:
    """A count (an int > 0) or a string of Slurm's ``pattern``: salloc's value, as a string."""
    matches = re.compile(pattern, re.I).fullmatch

    def check(value: Any) -> str:
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return str(value)
        if isinstance(value, str) and matches(value.strip()):
            return value.strip()
        raise ValueError(f"must be {says}")

    return check


#: Slurm's --time: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or no limit.
_TIME = _count_or(
    r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|UNLIMITED|INFINITE",
    "minutes (an int > 0) or a Slurm time limit like '30', '1:30:00', '2-00:00:00' or 'UNLIMITED'",
)
#: Slurm's --gpus-per-node: [type:]count.
_GPUS = _count_or(
    r"([A-Za-z0-9_.-]+:)?[1-9]\d*", "a GPU count (an int > 0) or 'type:count' like 'a100:4'"
)


def _args(value: Any) -> tuple[str, ...]:
    """Extra arguments: a list of strings, each one argument (no shell splitting)."""
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise ValueError("must be a list of strings, one argument each, like ['--qos=high']")
    if not all(isinstance(item, str) and item for item in value):
        raise ValueError("must hold non-empty strings only")
    return tuple(value)


@attrs.frozen(kw_only=True)
class SlurmOptions(MultiprocOptions):
    """What ``ExecutorConfig.backend_options`` may hold for ``backend="slurm"``: every key
    of ``mp`` (:class:`~executor_plugin_multiproc.MultiprocOptions`), and the Slurm ones
    below. The node count is ``ExecutorConfig.num_nodes`` (salloc's ``--nodes``).
    ``SlurmExecutor.options_cls``: the core refuses any other key."""

    #: salloc's ``--partition``, for an allocation this backend asks for.
    partition: str | None = option(None, optional(_word("a partition name")))
    #: salloc's ``--account``.
    account: str | None = option(None, optional(_word("an account name")))
    #: salloc's ``--time``: minutes, or ``"HH:MM:SS"``, ``"D-HH:MM:SS"``...
    time: str | None = option(None, optional(_TIME))
    #: salloc's ``--gpus-per-node``: a count or ``"type:count"``.
    gpus_per_node: str | None = option(None, optional(_GPUS))
    #: salloc's ``--nodelist``: nodes the allocation must include (a Slurm host list).
    nodelist: str | None = option(None, optional(_word("a Slurm host list")))
    #: More arguments for salloc, e.g. ``["--qos=high", "--exclusive"]``.
    salloc_args: tuple[str, ...] = option((), _args)
    #: More arguments for each agent's srun, e.g. ``["--cpus-per-task=16"]``.
    srun_args: tuple[str, ...] = option((), _args)
    #: Seconds an allocation this backend asks for may pend before the start fails (with
    #: squeue's reason) and the request is cancelled.
    pending_timeout_s: float = option(600.0, number(above=0.0))
    #: Whether this process runs node 0's ranks: None (the default) when it runs on a node of
    #: the allocation (``SLURMD_NODENAME``, in a batch script or an srun step), else not (a
    #: login node, a salloc shell); True insists (an error elsewhere); False never does (an
    #: agent runs on this node too).
    driver_runs_ranks: bool | None = option(None, optional(boolean()))

    def salloc_argv(self, num_nodes: int) -> list[str]:
        """salloc's options for an allocation of ``num_nodes`` nodes."""
        argv = [f"--nodes={num_nodes}", "--ntasks-per-node=1"]
        for flag, value in (
            ("--partition", self.partition),
            ("--account", self.account),
            ("--time", self.time),
            ("--gpus-per-node", self.gpus_per_node),
            ("--nodelist", self.nodelist),
        ):
            if value is not None:
                argv.append(f"{flag}={value}")
        return [*argv, *self.salloc_args]
