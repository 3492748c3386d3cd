"""How an ``executor node`` agent ends: its exit statuses, and what a refused agent should
do (the remedy for each of the driver's refusals)."""

from __future__ import annotations

from typing import Any

from executor_channel import hub as wire

__all__ = ["DRIVER_LOST_EXIT", "REFUSED_EXIT", "REJOIN", "remedy"]

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
    wire.Refusal.MALFORMED: "install the same version of the executor packages on every machine",
    wire.Refusal.VERSION: "then start this agent again",
    wire.Refusal.MISMATCH: (
        "start this agent with --num-nodes equal to the driver's num_nodes, or without it"
    ),
    wire.Refusal.OUT_OF_RANGE: "start it with one of those node ranks (--node-rank)",
    wire.Refusal.NOT_AWAITED: (
        "stop this agent; an agent joins a driver that is waiting for its node rank, so start "
        "it again for the next executor"
    ),
}


def remedy(info: dict[str, Any]) -> str:
    """What a refused agent should do, from the driver's REFUSED message ("" if unknown)."""
    refusal = str(info.get("refusal", ""))
    if refusal == wire.Refusal.TAKEN:
        awaited = info.get("awaited")
        if isinstance(awaited, list) and awaited:
            ranks = ", ".join(str(rank) for rank in awaited)
            return (
                "each node rank takes one agent: stop this one, or start it with a node rank "
                f"still awaited (--node-rank {ranks})"
            )
        return "each node rank takes one agent, and every one has its agent: stop this one"
    return _REMEDIES.get(refusal, "")
