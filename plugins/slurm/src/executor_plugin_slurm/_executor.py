"""The ``slurm`` backend: ``mp``'s executor whose node agents run as Slurm job steps.

:class:`SlurmPlacement` is a :class:`~executor_plugin_multiproc.launcher.Placement`: for each
node it runs ``executor node`` in a step of its own (``srun --nodes=1 --ntasks=1 --nodelist
NODE``), inside the allocation this process is in, or in one it asks for with ``salloc``
(kept across the executor's group restarts, released when the executor is done with it:
``Placement.close``). Everything else (the secret, the port, the
admission of agents, heartbeats, the rings, every rule of a call) is ``mp``'s.

Its options are ``mp``'s and its own (:class:`SlurmOptions`, the executor's ``options_cls``:
the placement receives them); a step that Slurm ends after the start (a cancelled or
preempted job, a node failure) is reported through ``Placement.agent_lost`` with what Slurm
said.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
from typing import Self

from executor_core import ConfigError, ExecutorConfig, ExecutorError
from executor_plugin_multiproc import MultiprocExecutor, MultiprocOptions
from executor_plugin_multiproc.launcher import AgentLaunch, Placement

from . import _commands
from ._allocation import Allocation, Where, where_am_i
from ._options import SlurmOptions
from ._step import AgentStep

__all__ = ["SlurmExecutor", "SlurmPlacement"]

logger = logging.getLogger("executor_plugin_slurm")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class SlurmPlacement(Placement):
    """Each node's agent in a job step of its own, on the nodes of a Slurm allocation.

    Made as :class:`_NodeZero` (``driver_runs_ranks = True``) when this process runs on a
    node of the allocation (see :attr:`SlurmOptions.driver_runs_ranks`)."""

    driver_runs_ranks = False
    #: Where this process runs, as Slurm's environment says (read once, when made).
    where: Where

    def __new__(cls, config: ExecutorConfig, options: MultiprocOptions) -> Self:
        where = where_am_i()
        if cls is SlurmPlacement and _runs_ranks(_slurm_options(options), where):
            cls = _NodeZero  # type: ignore[assignment]
        placement = super().__new__(cls)
        placement.where = where
        return placement

    def __init__(self, config: ExecutorConfig, options: MultiprocOptions) -> None:
        super().__init__(config, options)
        self.slurm = _slurm_options(options)
        self.allocation: Allocation | None = None
        #: The Slurm node of each node rank (node 0 first: this one, if it runs ranks).
        self.node_names: tuple[str, ...] = ()
        #: The steps running now, by node rank (a stopped one leaves it first).
        self.steps: dict[int, AgentStep] = {}

    # --- the contract ------------------------------------------------------------------

    def start(self, launch: AgentLaunch) -> None:
        if self.allocation is not None and self.allocation.ended() is not None:
            # A group restart after Slurm ended the job (cancelled, preempted, timed out):
            # whoever ended it meant the executor to end, not to queue again.
            raise ExecutorError(
                f"Slurm job {self.allocation.job_id} has ended{self._job_said()}: the "
                "executor cannot come back in it; create a new one"
            )
        if self.allocation is None:
            self.allocation = self._allocate()
        node = self.node_names[launch.node_rank]
        self.steps[launch.node_rank] = AgentStep(
            self.allocation.job_id,
            node,
            [*launch.argv, "--node-id", node],
            launch.env,
            self.slurm.srun_args,
            self._watch,
        )

    def check(self, launch: AgentLaunch) -> None:
        step = self.steps[launch.node_rank]
        status = step.ended()
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
        self._release()

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
            allocation = Allocation(where.job_id, where.nodes, None)
        else:
            name = f"executor-{os.getpid()}"
            allocation = Allocation.request(self.slurm, config.num_nodes, name)
        try:
            self.node_names = self._name_nodes(allocation)
            self._check_reachable()
        except BaseException:
            allocation.release()
            raise
        return allocation

    def _name_nodes(self, allocation: Allocation) -> tuple[str, ...]:
        nodes = allocation.nodes
        if self.driver_runs_ranks:
            assert self.where.node is not None
            nodes = (self.where.node, *(n for n in nodes if n != self.where.node))
        need = self.config.num_nodes
        if len(nodes) < need:
            raise ConfigError(
                "num_nodes",
                need,
                f"Slurm job {allocation.job_id} has {len(nodes)} node(s) "
                f"({','.join(nodes)}): ask for num_nodes nodes (salloc/sbatch --nodes) or "
                "lower num_nodes",
            )
        return nodes[:need]

    def _check_reachable(self) -> None:
        """A driver listening on loopback is reachable only from agents on this machine."""
        host = self.config.distributed_host
        if not _is_loopback(host):
            return
        placed = self.node_names[int(self.driver_runs_ranks) :]
        far = {
            node: addr
            for node, addr in _commands.node_addresses(placed).items()
            if not _is_loopback(addr)
        }
        if far:
            raise ConfigError(
                "distributed_host",
                host,
                f"the agents run on {', '.join(f'{n} ({a})' for n, a in far.items())} and "
                "cannot reach a driver listening on loopback: set distributed_host to this "
                "machine's address as those nodes reach it (or '0.0.0.0')",
            )

    def _release(self) -> None:
        allocation, self.allocation = self.allocation, None
        if allocation is not None:
            allocation.release()

    # --- a step that ends by itself ------------------------------------------------------

    def _job_said(self) -> str:
        allocation = self.allocation
        if allocation is None:
            return ""
        ended = allocation.ended()
        if ended is not None:
            return f"; salloc: {ended}"
        try:
            state = _commands.job_state(allocation.job_id)
        except ExecutorError:
            return ""
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
            if step.ended() == 0:
                return  # an agent exits 0 only when told to stop
            job = self._job_said()
            if not job:
                logger.warning("slurm: the step of %s ended: %s", step.node, step.said())
                return
            node, detail = step.node, f"Slurm ended its step: {step.said()}{job}"
        self._fail(node, detail)

    def _fail(self, node: str, detail: str) -> None:
        if node in self.node_names:  # the SDK ignores it before the start and after close
            self.agent_lost(self.node_names.index(node), detail)


#: What srun and slurmstepd write when Slurm ends a step, its node or its job.
_SLURM_ENDS = re.compile(r"Node failure on (?P<node>\S+)|\*\*\* (?:STEP|JOB) \S+ ON \S+ CANCELLED")


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


def _slurm_options(options: MultiprocOptions) -> SlurmOptions:
    if not isinstance(options, SlurmOptions):
        raise ExecutorError(
            "SlurmPlacement needs SlurmOptions: it is made by SlurmExecutor (backend 'slurm'), "
            f"whose options_cls they are, not with {type(options).__name__}"
        )
    return options
