"""Slurm's commands (each bounded; a failure quotes what the command said), and the allocation
the agents run in: this process's own (``SLURM_JOB_ID``), or one held by ``salloc`` while the
command salloc runs waits for its standard input, whose other end this process holds: closing
it (at shutdown) or this process dying in any way (SIGKILL too) makes salloc let go of the job.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import select
import shutil
import subprocess
import threading
import time
from collections import deque

import attrs

from executor_core import ExecutorError

from ._options import SlurmOptions

__all__ = ["Allocation", "Where", "command", "job_state", "node_addresses", "where_am_i"]

logger = logging.getLogger("executor_plugin_slurm")

#: Seconds any query or cancel may take (the controller answers in milliseconds when up).
_QUERY_S = 20.0
#: What the command salloc runs prints once the job is granted (then it waits for EOF).
_GRANTED = "executor-slurm-granted"
_HOLD = f'echo "{_GRANTED} $SLURM_JOB_ID $SLURM_JOB_NODELIST"; exec cat >/dev/null'
_JOB_ID = re.compile(r"job(?: allocation)? (\d+)")
#: Seconds salloc gets to relinquish the job once its command ended.
_RELEASE_S = 10.0


def command(name: str) -> str:
    """The path of Slurm's command ``name``; an error saying how to get it if missing."""
    path = shutil.which(name)
    if path is None:
        raise ExecutorError(
            f"the slurm backend needs Slurm's '{name}' on PATH (install the Slurm client "
            "commands, e.g. Debian's slurm-client, or load your cluster's slurm module)"
        )
    return path


def _run(*args: str) -> str:
    """Run a Slurm command: its stdout, or an error quoting its stderr."""
    try:
        done = subprocess.run(
            [command(args[0]), *args[1:]],
            capture_output=True,
            text=True,
            timeout=_QUERY_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise ExecutorError(
            f"'{' '.join(args)}' did not answer within {_QUERY_S:g} s: is slurmctld up "
            "(scontrol ping)?"
        ) from None
    if done.returncode:
        said = done.stderr.strip() or done.stdout.strip() or f"exit status {done.returncode}"
        raise ExecutorError(f"'{' '.join(args)}' failed: {said}")
    return done.stdout


def _hostnames(nodelist: str) -> tuple[str, ...]:
    """The node names of a Slurm host list (``n[1-3],gpu7``), in Slurm's order."""
    return tuple(_run("scontrol", "show", "hostnames", nodelist).split())


def node_addresses(nodes: tuple[str, ...]) -> dict[str, str]:
    """Each node's ``NodeAddr`` (how Slurm reaches it)."""
    out = _run("scontrol", "show", "node", "--oneliner", ",".join(nodes))
    return dict(re.findall(r"NodeName=(\S+) .*?NodeAddr=(\S+)", out))


def job_state(job_id: str) -> tuple[str, str] | None:
    """``(state, reason)`` of job ``job_id`` as ``squeue`` gives them (``("PENDING",
    "Resources")``), or None once Slurm forgot it (it ended ``MinJobAge`` ago)."""
    try:
        out = _run("squeue", "--noheader", "--jobs", job_id, "--format", "%T|%r")
    except ExecutorError as exc:
        if "Invalid job id" in str(exc):
            return None
        raise
    line = out.strip().splitlines()
    if not line:
        return None
    state, _, reason = line[0].partition("|")
    return state, reason


@attrs.frozen
class Where:
    """Where this process runs, as Slurm's environment says."""

    #: The allocation it is inside of (``SLURM_JOB_ID``), if any.
    job_id: str | None
    #: That allocation's nodes (``SLURM_JOB_NODELIST``), in Slurm's order.
    nodes: tuple[str, ...]
    #: The allocated node this process runs on (``SLURMD_NODENAME``: a batch script, an
    #: srun step), if any; None on a login node or in a salloc shell.
    node: str | None


def where_am_i() -> Where:
    """Read Slurm's environment (a job's node list is expanded with ``scontrol``)."""
    job_id = os.environ.get("SLURM_JOB_ID") or os.environ.get("SLURM_JOBID")
    if not job_id:
        return Where(None, (), None)
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    nodes = _hostnames(nodelist) if nodelist else ()
    node = os.environ.get("SLURMD_NODENAME")
    return Where(job_id, nodes, node if node in nodes else None)


class Allocation:
    """A job whose nodes the agents' steps run on: this process's own, or one asked for by
    :meth:`request`, held by ``salloc ... sh -c 'echo ...; exec cat >/dev/null'`` until
    :meth:`release` ends it."""

    _reader: threading.Thread  # salloc's stderr, read into _lines

    def __init__(self, job_id: str, nodes: tuple[str, ...] = ()) -> None:
        #: The job's id ("" until salloc names the job it asks for), and its nodes.
        self.job_id, self.nodes = job_id, nodes
        self._salloc: subprocess.Popen[str] | None = None
        self._granted = False
        self._lines: deque[str] = deque(maxlen=20)

    @classmethod
    def request(cls, options: SlurmOptions, num_nodes: int, name: str) -> Allocation:
        """Ask Slurm for ``num_nodes`` nodes with salloc and wait, up to
        ``options.pending_timeout_s``, until they are granted."""
        self = cls("")
        argv = [*options.salloc_argv(num_nodes), f"--job-name={name}", "--", "/bin/sh", "-c"]
        self._salloc = salloc = subprocess.Popen(
            [command("salloc"), *argv, _HOLD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # a Ctrl-C at the driver's terminal is the driver's
        )
        self._reader = threading.Thread(
            target=self._read_stderr, args=(salloc,), name="executor-slurm-salloc", daemon=True
        )
        self._reader.start()
        try:
            self.nodes = _hostnames(self._wait_granted(salloc, options.pending_timeout_s))
        except BaseException:
            self.release()
            raise
        logger.info("slurm: job %s granted on %s", self.job_id, ",".join(self.nodes))
        return self

    def _read_stderr(self, salloc: subprocess.Popen[str]) -> None:
        assert salloc.stderr is not None
        for line in salloc.stderr:
            self._lines.append(line.rstrip())
            if not self.job_id and (found := _JOB_ID.search(line)):
                self.job_id = found[1]

    def _said(self, salloc: subprocess.Popen[str]) -> str:
        """salloc's last lines (its own messages: granted, pending, revoked, errors)."""
        return "; ".join(self._lines) or f"salloc exited with status {salloc.poll()}"

    def _wait_granted(self, salloc: subprocess.Popen[str], bound: float) -> str:
        """Block until salloc's command runs: the node list. Raises, saying what Slurm said,
        if salloc fails or the job still pends after ``bound`` seconds."""
        assert salloc.stdout is not None
        deadline = time.monotonic() + bound
        reported = False
        while (left := deadline - time.monotonic()) > 0:
            if select.select([salloc.stdout], [], [], min(left, 1.0))[0]:
                line = salloc.stdout.readline()
                if line.startswith(_GRANTED):
                    _, self.job_id, nodelist = line.split()
                    self._granted = True
                    return nodelist
                if not line:  # salloc ended without running its command
                    salloc.wait(_RELEASE_S)
                    self._reader.join(_RELEASE_S)
                    raise ExecutorError(f"Slurm refused the allocation: {self._said(salloc)}")
            elif not reported and self.job_id:
                state = job_state(self.job_id)
                if state is not None and state[0] == "PENDING":
                    logger.warning(
                        "slurm: job %s is pending (%s); waiting up to %g s",
                        self.job_id,
                        state[1],
                        bound,
                    )
                    reported = True
        state = job_state(self.job_id) if self.job_id else None
        reason = f"{state[0]}, reason {state[1]}" if state is not None else self._said(salloc)
        raise ExecutorError(
            f"Slurm did not grant job {self.job_id or None} within pending_timeout_s={bound:g} "
            f"s ({reason}, as squeue says); the request is cancelled. Ask for less (num_nodes, "
            "gpus_per_node, time), another partition, or wait longer (pending_timeout_s)"
        )

    def ended(self) -> str | None:
        """For an allocation this backend asked for: what salloc said if it ended (the job
        was cancelled, preempted, timed out), else None."""
        salloc = self._salloc
        if salloc is None or salloc.poll() is None:
            return None
        return self._said(salloc)

    def release(self) -> None:
        """End the allocation if this backend asked for it: let salloc's command end (EOF), so
        that salloc relinquishes the job; cancel the job and kill salloc if it does not, within
        a bound. Idempotent."""
        salloc, self._salloc = self._salloc, None
        if salloc is None:
            return
        if salloc.stdin is not None:
            with contextlib.suppress(OSError):
                salloc.stdin.close()
        if salloc.poll() is None and not self._granted:
            salloc.terminate()  # still pending: salloc cancels its request
        try:
            salloc.wait(_RELEASE_S)
        except subprocess.TimeoutExpired:
            if self.job_id:
                try:
                    _run("scancel", self.job_id)
                except ExecutorError as exc:
                    if "Invalid job id" not in str(exc) and "already completing" not in str(exc):
                        logger.warning("slurm: could not cancel job %s: %s", self.job_id, exc)
            salloc.kill()
            salloc.wait()
        self._reader.join(_RELEASE_S)
        for stream in (salloc.stdout, salloc.stderr):
            if stream is not None:
                stream.close()
