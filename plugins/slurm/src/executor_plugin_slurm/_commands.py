"""Slurm's commands as this plugin runs them: each one bounded by a timeout, and a failure
raised as an :class:`~executor_core.ExecutorError` that quotes what the command said."""

from __future__ import annotations

import shutil
import subprocess

from executor_core import ExecutorError

__all__ = ["cancel", "command", "hostnames", "job_state", "node_addresses", "run"]

#: Seconds any query or cancel may take (the controller answers in milliseconds when up).
QUERY_TIMEOUT_S = 20.0


def command(name: str) -> str:
    """The path of Slurm's command ``name``; an error saying how to get it if missing."""
    path = shutil.which(name)
    if path is None:
        raise ExecutorError(
            f"the slurm backend needs Slurm's '{name}' on PATH (install the Slurm client "
            "commands, e.g. Debian's slurm-client, or load your cluster's slurm module)"
        )
    return path


def run(*args: str, timeout: float = QUERY_TIMEOUT_S) -> str:
    """Run ``args`` (a Slurm command and its arguments); its stdout, or an error quoting
    its stderr."""
    argv = [command(args[0]), *args[1:]]
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        raise ExecutorError(
            f"'{' '.join(args)}' did not answer within {timeout:g} s: is slurmctld up "
            "(scontrol ping)?"
        ) from None
    if done.returncode:
        said = done.stderr.strip() or done.stdout.strip() or f"exit status {done.returncode}"
        raise ExecutorError(f"'{' '.join(args)}' failed: {said}")
    return done.stdout


def hostnames(nodelist: str) -> tuple[str, ...]:
    """The node names of a Slurm host list (``n[1-3],gpu7``), in Slurm's order."""
    return tuple(run("scontrol", "show", "hostnames", nodelist).split())


def node_addresses(nodes: tuple[str, ...]) -> dict[str, str]:
    """Each node's ``NodeAddr`` (how Slurm reaches it)."""
    out = run("scontrol", "show", "node", "--oneliner", ",".join(nodes))
    addresses: dict[str, str] = {}
    for line in out.splitlines():
        fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
        if "NodeName" in fields:
            addresses[fields["NodeName"]] = fields.get("NodeAddr", fields["NodeName"])
    return addresses


def job_state(job_id: str) -> tuple[str, str] | None:
    """``(state, reason)`` of job ``job_id`` as ``squeue`` gives them (``("PENDING",
    "Resources")``), or None once Slurm forgot it (it ended ``MinJobAge`` ago)."""
    try:
        out = run("squeue", "--noheader", "--jobs", job_id, "--format", "%T|%r")
    except ExecutorError as exc:
        if "Invalid job id" in str(exc):
            return None
        raise
    line = out.strip().splitlines()
    if not line:
        return None
    state, _, reason = line[0].partition("|")
    return state, reason


def cancel(job_id: str) -> None:
    """``scancel`` the job (or step, ``JOB.STEP``); one that ended already is no error."""
    try:
        run("scancel", job_id)
    except ExecutorError as exc:
        if "Invalid job id" not in str(exc) and "already completing" not in str(exc):
            raise
