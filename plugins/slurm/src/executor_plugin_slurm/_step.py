"""One node's agent as a Slurm job step: ``srun --jobid J --nodes=1 --ntasks=1 --nodelist
NODE --overlap ... executor node ...``, and what srun says about it.

srun's standard error (its own messages and the agent's) is passed on to this process's and
its last lines are kept: they are what Slurm said when the step ends (``srun: error: Node
failure on n2``, ``*** STEP 12.0 ON n1 CANCELLED AT ...``). The agent's standard output is
this process's, as ``mp``'s workers' is.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from . import _commands

__all__ = ["AgentStep"]


class AgentStep:
    """srun running one agent. From its reader thread, unless :meth:`stop` was called
    first, ``watch(step, line)`` is called with each line srun writes on standard error,
    and ``watch(step, None)`` once srun exited."""

    def __init__(
        self,
        job_id: str,
        node: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        srun_args: Sequence[str],
        watch: Callable[[AgentStep, str | None], None],
    ) -> None:
        self.job_id = job_id
        self.node = node
        self.stopping = False
        self._watch = watch
        self._lines: deque[str] = deque(maxlen=12)
        srun = [
            _commands.command("srun"),
            f"--jobid={job_id}",
            "--nodes=1",
            "--ntasks=1",
            "--ntasks-per-node=1",
            f"--nodelist={node}",
            # The driver's own step (if it runs in one) or another executor's agents may
            # hold the node's CPUs: an agent never waits for them.
            "--overlap",
            # Everything the driver has (the venv, PYTHONPATH, SLURM_CONF) and the secret,
            # which travels in the launch request to slurmd, never on a command line.
            "--export=ALL",
            f"--job-name=executor-node-{node}",
            *srun_args,
            "--",
            *argv,
        ]
        self.process = subprocess.Popen(
            srun,
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,  # srun would forward the driver's stdin to the agent
            stderr=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C at the driver's terminal is the driver's
        )
        self._reader = threading.Thread(
            target=self._read, name=f"executor-slurm-srun-{node}", daemon=True
        )
        self._reader.start()

    def _read(self) -> None:
        stream = self.process.stderr
        assert stream is not None
        for raw in stream:
            with contextlib.suppress(OSError):
                os.write(2, raw)
            line = raw.decode(errors="replace").rstrip()
            self._lines.append(line)
            if not self.stopping:
                self._watch(self, line)
        self.process.wait()
        if not self.stopping:
            self._watch(self, None)

    def ended(self) -> int | None:
        """srun's exit status once it exited, else None."""
        return self.process.poll()

    def said(self) -> str:
        """srun's last lines (Slurm's messages and the agent's), for an error."""
        lines = [line for line in self._lines if line]
        return " | ".join(lines[-6:]) or "nothing on stderr"

    def stop(self, timeout: float) -> None:
        """Reap srun (its agent was told to stop and is exiting): after ``timeout`` seconds
        cancel the step through srun (SIGTERM twice in a row), then kill srun."""
        self.stopping = True
        process = self.process
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                process.wait(5.0)
            except subprocess.TimeoutExpired:
                # An srun whose controller went away ignores SIGTERM.
                process.kill()
                process.wait()
        self._reader.join(5.0)
        if process.stderr is not None:
            process.stderr.close()
