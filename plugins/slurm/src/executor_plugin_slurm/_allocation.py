"""The Slurm allocation an executor's agents run in: the one this process is inside of
(``SLURM_JOB_ID``), or one asked for with ``salloc`` and released at the end.

An allocation this backend asks for is held by ``salloc`` running a command that waits for
its standard input to close: this process holds the other end. Closing it (at shutdown)
makes salloc relinquish the job; so does this process dying in any way, SIGKILL included,
since the kernel closes the pipe then. No job outlives its driver.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import select
import subprocess
import threading
import time
from collections import deque

import attrs

from executor_core import ExecutorError

from . import _commands
from ._options import SlurmOptions

__all__ = ["Allocation", "Where", "where_am_i"]

logger = logging.getLogger("executor_plugin_slurm")

#: What the command salloc runs prints once the job is granted (then it waits for EOF).
_GRANTED = "executor-slurm-granted"
_HOLD = f'echo "{_GRANTED} $SLURM_JOB_ID $SLURM_JOB_NODELIST"; exec cat >/dev/null'
_JOB_ID = re.compile(r"job(?: allocation)? (\d+)")
#: Seconds salloc gets to relinquish the job once its command ended.
_RELEASE_S = 10.0


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
    nodes = _commands.hostnames(nodelist) if nodelist else ()
    node = os.environ.get("SLURMD_NODENAME")
    return Where(job_id, nodes, node if node in nodes else None)


class Allocation:
    """A job whose nodes the agents' steps run on; :meth:`release` ends it if it is ours."""

    def __init__(self, job_id: str, nodes: tuple[str, ...], holder: _Holder | None) -> None:
        self.job_id = job_id
        self.nodes = nodes
        self._holder = holder

    @property
    def owned(self) -> bool:
        """True: this backend asked for it (and releases it)."""
        return self._holder is not None

    @classmethod
    def request(cls, options: SlurmOptions, num_nodes: int, name: str) -> Allocation:
        """Ask Slurm for ``num_nodes`` nodes with salloc and wait, up to
        ``options.pending_timeout_s``, until they are granted."""
        holder = _Holder(options, num_nodes, name)
        try:
            job_id, nodelist = holder.wait_granted(options.pending_timeout_s)
            nodes = _commands.hostnames(nodelist)
        except BaseException:
            holder.release()
            raise
        logger.info("slurm: job %s granted on %s", job_id, ",".join(nodes))
        return cls(job_id, nodes, holder)

    def ended(self) -> str | None:
        """For an owned allocation: what salloc said if it ended (the job was cancelled,
        preempted, timed out), else None."""
        holder = self._holder
        if holder is None or holder.process.poll() is None:
            return None
        return holder.said()

    def release(self) -> None:
        """End the allocation if it is ours (bounded; the job is cancelled if salloc does
        not let go of it). Idempotent."""
        holder, self._holder = self._holder, None
        if holder is not None:
            holder.release()


class _Holder:
    """``salloc ... sh -c 'echo ...; exec cat >/dev/null'``, its pipes and what it said."""

    def __init__(self, options: SlurmOptions, num_nodes: int, name: str) -> None:
        argv = [
            _commands.command("salloc"),
            *options.salloc_argv(num_nodes),
            f"--job-name={name}",
            "--",
            "/bin/sh",
            "-c",
            _HOLD,
        ]
        self.job_id: str | None = None
        #: True once the job runs (salloc's command printed the grant).
        self.granted = False
        self._lines: deque[str] = deque(maxlen=20)
        self.process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # a Ctrl-C at the driver's terminal is the driver's
        )
        self._reader = threading.Thread(
            target=self._read_stderr, name="executor-slurm-salloc", daemon=True
        )
        self._reader.start()

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            line = line.rstrip()
            self._lines.append(line)
            if self.job_id is None and (found := _JOB_ID.search(line)):
                self.job_id = found[1]

    def said(self) -> str:
        """salloc's last lines (its own messages: granted, pending, revoked, errors)."""
        return "; ".join(self._lines) or f"salloc exited with status {self.process.poll()}"

    def wait_granted(self, bound: float) -> tuple[str, str]:
        """Block until salloc's command runs: ``(job id, node list)``. Raises, saying
        what Slurm said, if salloc fails or the job still pends after ``bound`` seconds."""
        process = self.process
        assert process.stdout is not None
        deadline = time.monotonic() + bound
        reported = False
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ExecutorError(self._pending_error(bound))
            ready, _, _ = select.select([process.stdout], [], [], min(left, 1.0))
            if ready:
                line = process.stdout.readline()
                if line.startswith(_GRANTED):
                    _, job_id, nodelist = line.split()
                    self.job_id, self.granted = job_id, True
                    return job_id, nodelist
                if not line:  # salloc ended without running its command
                    process.wait(_RELEASE_S)
                    self._reader.join(_RELEASE_S)
                    raise ExecutorError(f"Slurm refused the allocation: {self.said()}")
            elif not reported and self.job_id is not None:
                state = _commands.job_state(self.job_id)
                if state is not None and state[0] == "PENDING":
                    logger.warning(
                        "slurm: job %s is pending (%s); waiting up to %g s",
                        self.job_id,
                        state[1],
                        bound,
                    )
                    reported = True

    def _pending_error(self, bound: float) -> str:
        job_id = self.job_id
        state = _commands.job_state(job_id) if job_id is not None else None
        reason = f"{state[0]}, reason {state[1]}" if state is not None else self.said()
        return (
            f"Slurm did not grant job {job_id} within pending_timeout_s={bound:g} s "
            f"({reason}, as squeue says); the request is cancelled. Ask for less (num_nodes, "
            "gpus_per_node, time), another partition, or wait longer (pending_timeout_s)"
        )

    def release(self) -> None:
        """Let salloc's command end (EOF), so that salloc relinquishes the job; cancel the
        job and kill salloc if it does not, within a bound."""
        process = self.process
        if process.stdin is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()
        if process.poll() is None and not self.granted:
            process.terminate()  # still pending: salloc cancels its request
        try:
            process.wait(_RELEASE_S)
        except subprocess.TimeoutExpired:
            if self.job_id is not None:
                try:
                    _commands.cancel(self.job_id)
                except ExecutorError as exc:
                    logger.warning("slurm: could not cancel job %s: %s", self.job_id, exc)
            process.kill()
            process.wait()
        self._reader.join(_RELEASE_S)
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()
