"""The other nodes' agents of a multi-node executor: its placement, kept across group
restarts, and the start of its agents until each has joined the driver's hub."""

from __future__ import annotations

import functools
import socket
from collections.abc import Callable

from executor_channel import Doorbell
from executor_core import ConfigError, ExecutorError, ExecutorFailedError, NodeLostError
from executor_core.backend import TransportHost

from ._options import MultiprocOptions
from .launcher import AgentLaunch, Placement, agent_argv

# Not typing.TYPE_CHECKING's import cost; type checkers treat any constant of this name as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from executor_channel import Hub  # zmq: imported by multi-node executors only

__all__ = ["join_nodes", "placement_for"]

#: Under this name a group restart hands the placement to the next incarnation.
_KEPT = "placement"
#: Under this name a group restart hands on the nodes whose agents were lost:
#: ``{node_rank: (node_id, ranks)}``.
_LOST = "lost_nodes"


def remember_lost(host: TransportHost, hub: Hub) -> None:
    """A group restart follows: hand the next incarnation the nodes whose agents were lost,
    so that if none joins again for one of them, its start says that node is gone."""
    lost = {node.node_rank: (node.node_id, node.ranks) for node in hub.nodes if node.lost}
    if lost:
        host.keep(_LOST, lost, lambda: None)


def placement_for(
    host: TransportHost, placement_cls: type[Placement], options: MultiprocOptions
) -> Placement:
    """The executor's placement: the one the previous incarnation kept, or a new one. Its
    cleanup, the incarnation's last (registered first), keeps it for the next incarnation
    while the executor restarts, and closes it otherwise."""
    placement: Placement = host.take(_KEPT) or placement_cls(host.config, options)
    host.keep(_KEPT, placement, placement.close)
    return placement


def join_nodes(
    host: TransportHost,
    placement: Placement,
    options: MultiprocOptions,
    reply_bell: Doorbell,
    on_failure: Callable[[ExecutorFailedError], None],
    local: int,
) -> Hub:
    """Listen for the agents of the nodes without the driver's ranks (all of them when the
    driver runs none: ``local`` is 0), have the placement start them, and wait until each
    has joined."""
    # zmq: imported by multi-node executors only
    from executor_channel import ChannelError, Hub, Listener

    from . import __version__

    config = host.config
    secret = placement.secret()
    port = placement.port()
    try:
        listener = Listener(secret, host=config.distributed_host, port=port)
    except ChannelError as exc:  # the port is taken
        raise ConfigError(
            "backend_options",
            {"node_port": port},
            f"{exc}; pick a free port with backend_options['node_port'] (and the agents' "
            "--master-port)",
        ) from None
    host.add_cleanup(listener.close)
    master = config.distributed_host
    if master in ("0.0.0.0", "::"):  # listening everywhere: agents dial this host's name
        master = socket.gethostname()
    launches = tuple(
        AgentLaunch(
            node_rank=node_rank,
            argv=agent_argv(
                node_rank, config.num_nodes, master, listener.port, options.startup_timeout
            ),
            env=secret.to_env(),
            secret=secret,
            address=listener.address,
        )
        for node_rank in range(int(bool(local)), config.num_nodes)
    )
    nodes = Hub(listener, options.node_timeout_s, reply_bell, on_failure)
    # Cleanups run last in, first out: the hub tells the agents to stop, then the
    # placement reaps them.
    for launch in launches:
        placement.start(launch)
        host.add_cleanup(functools.partial(placement.stop, launch))
    host.add_cleanup(lambda: nodes.stop(False, 0.0))
    by_rank = {launch.node_rank: launch for launch in launches}

    def check(awaited: frozenset[int]) -> None:
        for node_rank in sorted(awaited):
            placement.check(by_rank[node_rank])

    lost: dict[int, tuple[str, tuple[int, ...]]] = host.take(_LOST) or {}
    try:
        nodes.join(
            list(by_rank),
            __version__,
            options.startup_timeout,
            placement.hint(launches),
            terms={"num_nodes": config.num_nodes},  # an agent's --num-nodes, if it gave one
            check=check,
        )
    except ExecutorError as exc:
        gone = sorted(set(lost) & nodes.awaited)
        if not gone:
            raise
        # One attempt, bounded by startup_timeout: another would wait as long for nothing.
        node_id, ranks = lost[gone[0]]
        raise NodeLostError(
            node_id,
            ranks,
            f"its agent was lost, and none joined again within startup_timeout="
            f"{options.startup_timeout:g} s ({exc})",
            f"start an agent for node rank {gone[0]} there, then call recover() (or create "
            "a new executor)",
        ) from exc
    return nodes
