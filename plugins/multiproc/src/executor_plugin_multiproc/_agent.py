"""``executor node``: the agent that runs one node's workers for a driver on another machine.

The agent dials the driver's listener (authenticated with the shared secret), says which
node it is, receives its :class:`~._node_protocol.NodeSpec` (or, at once, the driver's
refusal: one line on stderr with the reason and what to do, exit status 2; no driver within
the join timeout is one line too, status 3), starts that node's workers on a
shared-memory channel of its own, and then relays: each call frame from the driver is
written once into the node's ring (every local worker reads it), and each reply frame is
sent back as it is, never unpickled here (one session: :class:`~._node_agent.NodeAgent`).

Heartbeats both ways: if the driver falls silent for ``node_timeout_s`` (it died, or its
machine or the network did), the agent stops its workers and exits; if the agent dies, its
workers see it (parent-death signal and death pipe) and exit, and the driver sees its
silence.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys

from executor_channel import ChannelError, ChannelTimeoutError, Connection, Secret, SecretError

from ._agent_status import DRIVER_LOST_EXIT, REFUSED_EXIT, REJOIN
from ._node_agent import NodeAgent

__all__ = ["DRIVER_LOST_EXIT", "REFUSED_EXIT", "run_agent"]

logger = logging.getLogger("executor_plugin_multiproc.agent")


def run_agent(
    node_rank: int,
    master_addr: str,
    master_port: int,
    join_timeout: float,
    *,
    num_nodes: int | None = None,
    secret: Secret | None = None,
    node_id: str | None = None,
    address: str | None = None,
) -> int:
    """Join the driver at ``master_addr:master_port`` as ``node_rank`` and serve until it
    stops this node; returns the process's exit status.

    ``num_nodes``, if given, is what this agent expects of the driver's config (a driver
    with another ``num_nodes`` refuses it). ``secret`` defaults to :func:`Secret.load`'s.
    ``node_id`` (default: the host name) and ``address`` (default: the address this machine
    uses to reach the driver) are how the driver, the workers and errors name this node.
    Every failure to join is one line on stderr saying what to check, not a traceback.
    """
    if secret is None:
        try:
            secret = Secret.load()
        except SecretError as exc:
            print(f"executor node: error: {exc}", file=sys.stderr)
            return REFUSED_EXIT
    host = f"[{master_addr}]" if ":" in master_addr else master_addr
    driver = f"tcp://{host}:{master_port}"
    if address is None:
        address = _route_address(master_addr, master_port)
    identity = {"node_id": node_id or socket.gethostname(), "address": address}
    # SIGTERM (a scheduler stopping this job) ends the agent like Ctrl-C: workers stopped.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        while True:
            status = _join_and_serve(driver, secret, node_rank, join_timeout, num_nodes, identity)
            if status != REJOIN:
                return status
            # The driver restarts its workers (a recovery): join its next incarnation.
            logger.info("node %d: the driver restarts its workers; joining again", node_rank)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _join_and_serve(
    driver: str,
    secret: Secret,
    node_rank: int,
    join_timeout: float,
    num_nodes: int | None,
    identity: dict[str, str],
) -> int:
    """Dial the driver, join and serve until it stops this node: the exit status, or
    :data:`REJOIN`."""
    logger.info("node %d: joining the driver at %s", node_rank, driver)
    try:
        link = Connection(driver, secret, timeout=join_timeout)
    except ChannelTimeoutError:
        print(
            f"executor node: no driver answered at {driver} within --join-timeout="
            f"{join_timeout:g} s. Check that an mp executor with num_nodes > {node_rank} is "
            "starting there (--master-addr and --master-port are its distributed_host and "
            "backend_options['node_port']), that this machine can reach that port, and that "
            "both sides hold the same secret (fingerprint "
            f"{secret.fingerprint} here; a driver refusing another secret logs a warning "
            "with its own fingerprint).",
            file=sys.stderr,
        )
        return DRIVER_LOST_EXIT
    except ChannelError as exc:
        print(f"executor node: could not dial the driver at {driver}: {exc}", file=sys.stderr)
        return DRIVER_LOST_EXIT
    with link:
        return NodeAgent(link, node_rank, join_timeout, num_nodes, identity).run()


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _route_address(master_addr: str, master_port: int) -> str:
    """The local address this machine uses to reach the driver (a UDP socket's route: no
    packet is sent); "" if there is none."""
    family = socket.AF_INET6 if ":" in master_addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((master_addr, master_port))
            return str(probe.getsockname()[0])
    except OSError:  # a name that does not resolve yet: the driver shows no address
        return ""
