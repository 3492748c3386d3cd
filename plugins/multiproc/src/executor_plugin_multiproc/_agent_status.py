"""How an ``executor node`` agent ends: its exit statuses, the driver's answer to its join
(its spec, or why not), and what a refused agent should do (the remedy for each refusal)."""

from __future__ import annotations

import pickle
import sys
from typing import Any

from executor_channel import ChannelTimeoutError, Connection, Op, Refusal
from executor_core import ExecutorError

from ._node_protocol import NodeSpec

__all__ = ["DRIVER_LOST_EXIT", "REFUSED_EXIT", "REJOIN", "receive_spec", "remedy"]

#: Exit status of an agent that found no driver, or whose driver went silent or failed.
DRIVER_LOST_EXIT = 3
#: Exit status of an agent the driver refused (or released before it started), and of a
#: usage error.
REFUSED_EXIT = 2

#: ``NodeAgent.run``'s status when the driver asked this node to stop its workers and join
#: again (never an exit status).
REJOIN = -1


#: What an agent refused for each reason should do (the driver's reason says why).
_REMEDIES: dict[str, str] = {
    Refusal.MALFORMED: "install the same version of the executor packages on every machine",
    Refusal.VERSION: "then start this agent again",
    Refusal.MISMATCH: (
        "start this agent with --num-nodes equal to the driver's num_nodes, or without it"
    ),
    Refusal.OUT_OF_RANGE: "start it with one of those node ranks (--node-rank)",
    Refusal.NOT_AWAITED: (
        "stop this agent; an agent joins a driver that is waiting for its node rank, so start "
        "it again for the next executor"
    ),
}


def remedy(info: dict[str, Any]) -> str:
    """What a refused agent should do, from the driver's REFUSED message ("" if unknown)."""
    refusal = str(info.get("refusal", ""))
    if refusal == Refusal.TAKEN:
        awaited = info.get("awaited")
        if isinstance(awaited, list) and awaited:
            ranks = ", ".join(str(rank) for rank in awaited)
            return (
                "each node rank takes one agent: stop this one, or start it with a node rank "
                f"still awaited (--node-rank {ranks})"
            )
        return "each node rank takes one agent, and every one has its agent: stop this one"
    return _REMEDIES.get(refusal, "")


def receive_spec(link: Connection, node_rank: int, join_timeout: float) -> NodeSpec | int:
    """The answer to an agent's join: its node's spec, or the exit status (said why on
    stderr) if the driver refused the agent, gave up before it started, or did not answer
    within ``join_timeout``."""
    try:
        message = link.recv(join_timeout)
    except ChannelTimeoutError:
        print(
            f"executor node: the driver at {link.address} took this agent's connection but "
            f"did not answer its join within --join-timeout={join_timeout:g} s. A "
            "starting driver sends the agents their work once every node has joined: start "
            "the other nodes' agents, or give a longer --join-timeout. A driver that failed "
            "or is shutting down no longer answers: start this agent again for the next "
            "executor.",
            file=sys.stderr,
        )
        return DRIVER_LOST_EXIT
    op = bytes(message.parts[0]) if message.parts else b""
    if op == Op.REFUSED:
        info = Op.read(message.parts)
        reason = str(info.get("reason", "no reason given"))
        what_to_do = remedy(info)
        print(
            f"executor node: the driver at {link.address} refused node rank "
            f"{node_rank}: {reason}" + (f"; {what_to_do}" if what_to_do else ""),
            file=sys.stderr,
        )
        return REFUSED_EXIT
    if op == Op.KILL and Op.read(message.parts).get("rejoin") is True:
        return REJOIN
    if op == Op.KILL:
        print(
            f"executor node: the driver at {link.address} gave up before this node started "
            "(its start failed: see its error); start this agent again for the next executor",
            file=sys.stderr,
        )
        return REFUSED_EXIT
    if op != Op.SPEC or len(message.parts) != 2:
        raise ExecutorError(f"the driver sent {op!r} instead of this node's spec")
    # The link has authenticated the driver: only a holder of the secret sent this.
    spec = pickle.loads(message.parts[1])
    if not isinstance(spec, NodeSpec):
        raise ExecutorError(f"the driver sent a {type(spec).__name__} as this node's spec")
    return spec
