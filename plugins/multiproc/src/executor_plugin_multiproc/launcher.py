"""The launcher contract: where a multi-node ``mp`` executor's node agents run.

A backend that places work through its own scheduler (Slurm, Kubernetes, an in-house one)
supplies a :class:`Placement`: "start the agent for node N with this command and
environment" (:meth:`Placement.start`) and "stop and reap it" (:meth:`Placement.stop`).
Everything else is the SDK's: the command line and its environment (:class:`AgentLaunch`),
a fresh secret and a free port per executor, the admission of agents (a wrong, late or
duplicate one is refused with the reason), heartbeats, the rings of each node and every rule
of a call. A backend names its placement on a subclass of the ``mp`` executor::

    class ClusterExecutor(MultiprocExecutor):
        placement_cls = ClusterPlacement

``mp`` itself uses :class:`ManualPlacement`: someone else (a person, systemd, a job script)
starts ``executor node`` on each machine, with the secret of the driver's environment and
the port of ``backend_options['node_port']``.

The order, for one executor: the placement is built with the config and the options; the
driver listens (on ``config.distributed_host``, at :meth:`Placement.port`); for each node the
agent awaited, :meth:`Placement.start` is called once, from the thread that creates the
executor; :meth:`Placement.check` runs about once a second until every agent has joined;
:meth:`Placement.stop` is called once for each started agent after the executor has told the
agents to stop (at shutdown, after a failed start, or from the finalizer of an executor
dropped without shutdown). A group restart (a recovery) keeps the same placement: it stops the
agents and starts the next incarnation's through the same instance, so what it holds for
all of them (a scheduler's allocation) lives on; :meth:`Placement.close` runs once, when the
executor is done with it. A node lost after the start is asked of
:meth:`Placement.explain` (why), and its rank replacement calls :meth:`Placement.stop` and
:meth:`Placement.start` for it again, then awaits its new agent (``check`` meanwhile); the
other nodes' agents and workers stay.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable, Mapping
from typing import ClassVar

import attrs

from executor_channel import Secret, SecretError
from executor_core import ConfigError, ExecutorConfig

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._executor import MultiprocOptions

__all__ = ["AgentLaunch", "ManualPlacement", "Placement"]


@attrs.frozen(kw_only=True)
class AgentLaunch:
    """How to start one node's agent: run :attr:`argv` with :attr:`env` added to the
    environment, on the machine that is to be node :attr:`node_rank`."""

    #: The node this agent is for (``executor node --node-rank``).
    node_rank: int
    #: The command line: ``python -m executor_core node --node-rank N --num-nodes M
    #: --master-addr HOST --master-port PORT --join-timeout S``, with the driver's Python.
    #: Append ``--node-id NAME`` and ``--address ADDR`` to say what the machine is called
    #: and how the other nodes reach it; run another interpreter path on machines where
    #: Python lives elsewhere (``argv[1:]`` is the same for any).
    argv: tuple[str, ...]
    #: What the agent's environment must hold on top of its own: the secret
    #: (``EXECUTOR_CHANNEL_SECRET``). Pass it the way the scheduler keeps it private (its
    #: environment, or a file of mode 0600 named by ``EXECUTOR_CHANNEL_SECRET_FILE``).
    env: Mapping[str, str]
    #: The executor's secret itself, for a placement that writes it into a file.
    secret: Secret = attrs.field(repr=False)
    #: Where the driver listens: ``tcp://HOST:PORT``.
    address: str


class Placement:
    """Where a multi-node executor's agents run: subclass it and give :meth:`start` and
    :meth:`stop`. One instance per executor, across its group restarts; its methods are
    called from the threads that create, recover and shut down the executor, never at the
    same time."""

    #: True: the driver's machine runs node 0's ranks and the agents are nodes 1 ..
    #: ``num_nodes - 1`` (``mp``'s way). False: the driver runs no ranks (it may be a login
    #: node) and the agents are nodes 0 .. ``num_nodes - 1``; node 0's agent hosts the torch
    #: rendezvous at its address.
    driver_runs_ranks: ClassVar[bool] = True
    #: True: when the executor restarts its workers (a recovery), the agents stop theirs and
    #: join the next incarnation at the same address (the port must then be fixed:
    #: :meth:`port`). False: they exit, and the next incarnation's placement starts new ones.
    agents_rejoin: ClassVar[bool] = False

    def __init__(self, config: ExecutorConfig, options: MultiprocOptions) -> None:
        self.config = config
        #: The executor's options: an instance of its ``options_cls`` (a subclass of
        #: ``MultiprocOptions`` may carry the placement's own keys).
        self.options = options
        #: Set by the SDK while the executor runs (see :meth:`agent_lost`).
        self._report_lost: Callable[[int, str], None] | None = None

    def agent_lost(self, node_rank: int, detail: str) -> None:
        """Say, from any thread, that the scheduler ended the agent of ``node_rank`` after
        the start (a cancelled or preempted job, a failed node): its ranks' calls fail with a
        ``WorkerDiedError`` naming them, the node and ``detail`` (what the scheduler said),
        and the executor's recovery policy decides what follows, as for any lost node.
        Before the start returned (:meth:`check` is the way then) and once the executor
        closes, it does nothing. The SDK's: do not override."""
        report = self._report_lost
        if report is not None:
            report(node_rank, detail)

    def explain(self, node_rank: int) -> str:
        """Why the agent of ``node_rank`` is gone, as the scheduler tells it ("OOMKilled"):
        asked from a thread of the SDK's when the channel lost that node after the start,
        and awaited for at most a few seconds, during which the executor's error waits (it
        then ends with the answer). The default cannot tell: "" at once."""
        return ""

    def node_id(self) -> str:
        """What the driver's node is called in ``WorkerContext.node_id`` when it runs node
        0's ranks (:attr:`driver_runs_ranks`): by default this machine's host name; a
        scheduler's placement returns the scheduler's name for it."""
        return socket.gethostname()

    def secret(self) -> Secret:
        """The executor's secret: a fresh one (each executor its own, never the driver's
        environment)."""
        return Secret.generate()

    def port(self) -> int:
        """The port the driver listens on for the agents: 0, a free one chosen per
        executor (several executors in one process never collide)."""
        return 0

    def start(self, launch: AgentLaunch) -> None:
        """Start the agent for ``launch.node_rank`` (submit it to the scheduler). Return once
        it is on its way; its join is awaited for ``startup_timeout``. Raise to fail the
        start (the agents started before are stopped). Called again, after :meth:`stop`, for
        a node lost after the start: start a new agent unless the scheduler restarts the old
        one by itself."""
        raise NotImplementedError(f"{type(self).__qualname__} must define start(launch)")

    def check(self, launch: AgentLaunch) -> None:
        """While ``launch``'s agent has not joined: raise (an ``ExecutorError`` saying why)
        if it can no longer join, its process ended, say. The default cannot tell."""

    def stop(self, launch: AgentLaunch) -> None:
        """Stop and reap the agent of ``launch`` (called once per started agent, after the
        executor told the agents to stop: a well agent is exiting already). Return within
        a few seconds; kill what does not exit."""
        raise NotImplementedError(f"{type(self).__qualname__} must define stop(launch)")

    def close(self) -> None:
        """Release what serves every incarnation's agents (an allocation asked for at the
        first :meth:`start`): called once, after the last :meth:`stop`, when the executor
        shuts down, fails for good or is dropped; not between a group restart's stop and
        start. The default holds nothing."""

    def hint(self, launches: tuple[AgentLaunch, ...]) -> str:
        """What to check when agents did not join in time (ends the start's error)."""
        return (
            f"{type(self).__qualname__} started their agents: check that each one runs and "
            f"can reach {launches[0].address} (their output says why one exits)"
        )


class ManualPlacement(Placement):
    """``mp``'s own: agents are started by someone else (``executor node`` on each machine,
    by a person, systemd or a job script) with the driver's secret, read from this process's
    environment, and ``backend_options['node_port']``. Its agents rejoin after a recovery's
    restart: nobody else would start them again."""

    agents_rejoin: ClassVar[bool] = True

    def secret(self) -> Secret:
        try:
            return Secret.load()
        except SecretError as exc:
            raise ConfigError(
                "num_nodes",
                self.config.num_nodes,
                f"the node agents authenticate with a shared secret: {exc}",
            ) from None

    def port(self) -> int:
        return self.options.node_port

    def start(self, launch: AgentLaunch) -> None:
        """Nothing to start: the agents are someone else's (see :meth:`hint`)."""

    def stop(self, launch: AgentLaunch) -> None:
        """Nothing to reap: an agent told to stop exits by itself."""

    def hint(self, launches: tuple[AgentLaunch, ...]) -> str:
        port = launches[0].address.rsplit(":", 1)[1]
        return (
            "on each of those machines run 'executor node --node-rank N --master-addr HOST "
            f"--master-port {port}', where HOST is this machine's distributed_host as "
            "seen from there, with the same EXECUTOR_CHANNEL_SECRET (or "
            "EXECUTOR_CHANNEL_SECRET_FILE) as here"
        )


def agent_argv(
    node_rank: int, num_nodes: int, master_addr: str, port: int, join_timeout: float
) -> tuple[str, ...]:
    """The agent's command line (:attr:`AgentLaunch.argv`)."""
    return (
        sys.executable,
        "-m",
        "executor_core",
        "node",
        "--node-rank",
        str(node_rank),
        "--num-nodes",
        str(num_nodes),
        "--master-addr",
        master_addr,
        "--master-port",
        str(port),
        "--join-timeout",
        f"{join_timeout:g}",
    )
