"""What the hub knows of a joined member: :class:`Member`, from which its errors name the
member (:meth:`~Member.describe`) or the rank that died there (:func:`died_on`)."""

from __future__ import annotations

from typing import Any

import attrs

from executor_core import WorkerDiedError

from ._link import PeerId

__all__ = ["Member", "died_on"]


@attrs.define
class Member:
    """A joined member, as the hub sees it."""

    #: The index it joined under (a node rank, or a rank for a member serving one).
    node_rank: int
    hostname: str
    pid: int
    peer: PeerId
    #: The node's name: as the member stated it (``JOIN``'s ``node_id``), else its
    #: hostname, until :meth:`Hub.send_spec` gives the backend's.
    node_id: str = ""
    #: The member's address as it stated it (``JOIN``'s ``address``; "" if it gave none).
    address: str = ""
    #: A TCP port the member found free on its address (``JOIN``'s ``port``; 0 if none):
    #: where a rendezvous hosted on its machine may listen.
    port: int = 0
    ranks: tuple[int, ...] = ()
    last_seen: float = 0.0
    #: Its workers have stopped (it said BYE).
    done: bool = False
    lost: bool = False

    @classmethod
    def joined(cls, info: dict[str, Any], peer: PeerId) -> Member:
        """The member whose admitted ``JOIN`` said ``info``."""
        hostname = str(info["hostname"])
        return cls(
            int(info["node_rank"]),
            hostname,
            int(info["pid"]),
            peer,
            node_id=str(info.get("node_id") or hostname),
            address=str(info.get("address", "")),
            port=int(info.get("port", 0)),
        )

    def describe(self) -> str:
        """How errors name it: ``node-a at 10.0.0.5 (node rank 1, member pid 4242)``."""
        where = f" at {self.address}" if self.address else ""
        return f"{self.node_id}{where} (node rank {self.node_rank}, member pid {self.pid})"


def died_on(node: Member, info: dict[str, Any]) -> WorkerDiedError:
    """The error for ``info``, a ``DIED`` report of ``node``: which rank died there, and how."""
    rank = info.get("rank")
    code = info.get("exitcode")
    detail = f"on node {node.node_id}"
    if info.get("parent_died"):
        detail += ", it saw its node's member process die"
    if not isinstance(rank, int):
        rank = min(node.ranks, default=-1)
    if isinstance(code, int) and code < 0:
        return WorkerDiedError(rank, signal=-code, detail=detail, node=node.node_id)
    return WorkerDiedError(
        rank, exitcode=code if isinstance(code, int) else None, detail=detail, node=node.node_id
    )
