"""The ``slurm`` backend: ``mp``'s executor whose node agents run as Slurm job steps.

:class:`SlurmPlacement` (a :class:`~executor_plugin_multiproc.launcher.Placement`) runs each
node's ``executor node`` in a step of its own, in the allocation this process is in or in one
it asks for with ``salloc`` (kept across group restarts, released by ``Placement.close``); a
step that Slurm ends after the start is reported through ``Placement.agent_lost`` with what
Slurm said. Everything else (the secret, the port, admission, heartbeats, every rule of a
call) is ``mp``'s.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import subprocess
import threading
from collections import deque
from collections.abc import Callable
from typing import Self

from executor_core import ConfigError, ExecutorConfig, ExecutorError
from executor_plugin_multiproc import MultiprocExecutor, MultiprocOptions
from executor_plugin_multiproc.launcher import AgentLaunch, Placement

from ._allocation import Allocation, Where, command, job_state, node_addresses, where_am_i
from ._options import SlurmOptions

__all__ = ["AgentStep", "SlurmExecutor", "SlurmPlacement"]

logger = logging.getLogger("executor_plugin_slurm")

#: What srun and slurmstepd write when Slurm ends a step, its node or its job.
_SLURM_ENDS = re.compile(r"Node failure on (?P<node>\S+)|\*\*\* (?:STEP|JOB) \S+ ON \S+ CANCELLED")


def _is_loopback(host: str) -> bool:
    with contextlib.suppress(ValueError):
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    return False


class AgentStep:
    """srun running one node's agent (``srun --jobid J --nodes=1 --ntasks=1 --nodelist NODE
    --overlap ... executor node ...``). srun's standard error (its messages and the agent's) is
    passed on to this process's, its last lines kept (what Slurm said when the step ended);
    from its reader thread, unless :meth:`stop` was called first, ``watch(step, line)`` gets
    each line and ``watch(step, None)`` srun's exit. The agent's stdout is this process's."""

    def __init__(
        self,
        job_id: str,
        node: str,
        launch: AgentLaunch,
        srun_args: tuple[str, ...],
        watch: Callable[[AgentStep, str | None], None],
    ) -> None:
        self.job_id, self.node = job_id, node
        self.stopping, self._watch = False, watch
        self._lines: deque[str] = deque(maxlen=12)
        srun = [
            command("srun"),
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
            *launch.argv,
            "--node-id",
            node,
        ]
        self.process = subprocess.Popen(
            srun,
            env={**os.environ, **launch.env},
            stdin=subprocess.DEVNULL,  # srun would forward the driver's stdin to the agent
            stderr=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C at the driver's terminal is the driver's
        )
        self._reader = threading.Thread(
            target=self._read, name=f"executor-slurm-srun-{node}", daemon=True
        )
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for raw in self.process.stderr:
            with contextlib.suppress(OSError):
                os.write(2, raw)
            line = raw.decode(errors="replace").rstrip()
            self._lines.append(line)
            if not self.stopping:
                self._watch(self, line)
        self.process.wait()
        if not self.stopping:
            self._watch(self, None)

    def said(self) -> str:
        """srun's last lines (Slurm's messages and the agent's), for an error."""
        return " | ".join([line for line in self._lines if line][-6:]) or "nothing on stderr"

    def stop(self, timeout: float) -> None:
        """Reap srun (its agent was told to stop and is exiting): after ``timeout`` seconds
        cancel the step through srun (SIGTERM), then kill srun."""
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


class SlurmPlacement(Placement):
    """Each node's agent in a job step of its own, on the nodes of a Slurm allocation.

    Made as :class:`_NodeZero` (``driver_runs_ranks = True``) when this process runs on a
    node of the allocation (see :attr:`SlurmOptions.driver_runs_ranks`)."""

    driver_runs_ranks = False
    #: Where this process runs, as Slurm's environment says (read once, when made).
    where: Where
    slurm: SlurmOptions

    def __new__(cls, config: ExecutorConfig, options: MultiprocOptions) -> Self:
        assert isinstance(options, SlurmOptions)  # SlurmExecutor's options_cls
        where = where_am_i()
        if cls is SlurmPlacement and _runs_ranks(options, where):
            cls = _NodeZero  # type: ignore[assignment]
        placement = super().__new__(cls)
        placement.where, placement.slurm = where, options
        return placement

    def __init__(self, config: ExecutorConfig, options: MultiprocOptions) -> None:
        super().__init__(config, options)
        self.allocation: Allocation | None = None
        #: The Slurm node of each node rank (node 0 first: this one, if it runs ranks).
        self.node_names: tuple[str, ...] = ()
        #: The steps running now, by node rank (a stopped one leaves it first).
        self.steps: dict[int, AgentStep] = {}

    # --- the contract ------------------------------------------------------------------

    def start(self, launch: AgentLaunch) -> None:
        if self.allocation is not None and self.allocation.ended() is not None:
            # A recovery's new step after Slurm ended the job (cancelled, preempted, timed out):
            # whoever ended it meant the executor to end, not to queue again.
            raise ExecutorError(
                f"Slurm job {self.allocation.job_id} has ended{self._job_said()}: the "
                "executor cannot come back in it; create a new one"
            )
        if self.allocation is None:
            self.allocation = self._allocate()
        node = self.node_names[launch.node_rank]
        self.steps[launch.node_rank] = AgentStep(
            self.allocation.job_id, node, launch, self.slurm.srun_args, self._watch
        )

    def check(self, launch: AgentLaunch) -> None:
        step = self.steps[launch.node_rank]
        status = step.process.poll()
        if status is not None:
            raise ExecutorError(
                f"the srun step of node {launch.node_rank} ({step.node}, job "
                f"{step.job_id}) ended with status {status} before its agent joined: "
                f"{step.said()}{self._job_said()}"
            )

    def stop(self, launch: AgentLaunch) -> None:
        step = self.steps.pop(launch.node_rank, None)
        if step is not None:
            step.stop(self.options.shutdown_grace_s + 5.0)

    def close(self) -> None:
        allocation, self.allocation = self.allocation, None
        if allocation is not None:
            allocation.release()

    def node_id(self) -> str:
        # Node 0 is this one when the driver runs its ranks (_NodeZero).
        return self.node_names[0] if self.node_names else super().node_id()

    def hint(self, launches: tuple[AgentLaunch, ...]) -> str:
        job = self.allocation.job_id if self.allocation is not None else "?"
        return (
            f"their srun steps run in Slurm job {job} on {', '.join(self.node_names)} "
            f"('squeue --steps --jobs {job}'; srun passes their output on): each agent must "
            f"reach {launches[0].address} (set ExecutorConfig.distributed_host to this "
            "machine's address on the nodes' network)"
        )

    # --- the allocation ----------------------------------------------------------------

    def _allocate(self) -> Allocation:
        config, where = self.config, self.where
        if where.job_id is not None:
            allocation = Allocation(where.job_id, where.nodes)
        else:
            allocation = Allocation.request(self.slurm, config.num_nodes, f"executor-{os.getpid()}")
        try:
            nodes = allocation.nodes
            if self.driver_runs_ranks and where.node is not None:  # node 0 is this one
                nodes = (where.node, *(n for n in nodes if n != where.node))
            if len(nodes) < config.num_nodes:
                raise ConfigError(
                    "num_nodes",
                    config.num_nodes,
                    f"Slurm job {allocation.job_id} has {len(nodes)} node(s) "
                    f"({','.join(nodes)}): ask for num_nodes nodes (salloc/sbatch --nodes) or "
                    "lower num_nodes",
                )
            self.node_names = nodes[: config.num_nodes]
            self._check_reachable()
        except BaseException:
            allocation.release()
            raise
        return allocation

    def _check_reachable(self) -> None:
        """A driver listening on loopback is reachable only from agents on this machine."""
        host = self.config.distributed_host
        if not _is_loopback(host):
            return
        placed = self.node_names[int(self.driver_runs_ranks) :]
        far = {n: a for n, a in node_addresses(placed).items() if not _is_loopback(a)}
        if far:
            raise ConfigError(
                "distributed_host",
                host,
                f"the agents run on {', '.join(f'{n} ({a})' for n, a in far.items())} and "
                "cannot reach a driver listening on loopback: set distributed_host to this "
                "machine's address as those nodes reach it (or '0.0.0.0')",
            )

    # --- a step that ends by itself ------------------------------------------------------

    def _job_said(self) -> str:
        """What Slurm says of the job, for an error, unless it runs ("" then)."""
        allocation = self.allocation
        if allocation is None:
            return ""
        if (ended := allocation.ended()) is not None:
            return f"; salloc: {ended}"
        with contextlib.suppress(ExecutorError):
            state = job_state(allocation.job_id)
            if state is None:
                return f"; job {allocation.job_id} has ended"
            if state[0] != "RUNNING":
                return f"; job {allocation.job_id} is {state[0]} ({state[1]})"
        return ""

    def _watch(self, step: AgentStep, line: str | None) -> None:
        """srun's reader thread: a line srun wrote, or None once it exited (nobody stopped
        it). Before the start returned, :meth:`check` reports a step that ended; after,
        when Slurm ends the job or a node (a cancel, a preemption, a time limit, a node
        failure) the executor fails with what Slurm said, naming the ranks and the node. A
        step whose agent failed alone is ``mp``'s to report (a lost node)."""
        if step not in self.steps.values():
            return  # being stopped, or of the incarnation before a group restart
        if line is not None:
            found = _SLURM_ENDS.search(line)
            if found is None or (not found["node"] and "NODE FAILURE" in line):
                return  # a step cancelled for another node's failure: that one is named
            node = found["node"] or step.node
            detail = f"Slurm: {line.strip()}"
        else:
            if step.process.poll() == 0:
                return  # an agent exits 0 only when told to stop
            job = self._job_said()
            if not job:
                logger.warning("slurm: the step of %s ended: %s", step.node, step.said())
                return
            node, detail = step.node, f"Slurm ended its step: {step.said()}{job}"
        if node in self.node_names:  # the SDK ignores it before the start and after close
            self.agent_lost(self.node_names.index(node), detail)


class _NodeZero(SlurmPlacement):
    """This process runs node 0's ranks on its own node; agents on the others."""

    driver_runs_ranks = True


def _runs_ranks(options: SlurmOptions, where: Where) -> bool:
    """Whether the driver runs node 0's ranks (see :attr:`SlurmOptions.driver_runs_ranks`)."""
    if options.driver_runs_ranks is None:
        return where.node is not None
    if options.driver_runs_ranks and where.node is None:
        raise ConfigError(
            "backend_options",
            {"driver_runs_ranks": True},
            "this process runs on no node of a Slurm allocation (SLURMD_NODENAME is unset or "
            "not in SLURM_JOB_NODELIST): run it in the batch script or an srun step, or "
            "leave driver_runs_ranks unset",
        )
    return options.driver_runs_ranks


class SlurmExecutor(MultiprocExecutor):
    """``mp`` with its node agents placed by :class:`SlurmPlacement` (backend ``"slurm"``).

    ``executor.config.backend_options`` holds ``mp``'s keys and the Slurm ones (see
    :class:`~executor_plugin_slurm.SlurmOptions`)."""

    options_cls = SlurmOptions
    placement_cls = SlurmPlacement
