"""Whom a hub admits: :func:`refusal` gives the reason a joining member cannot be admitted
(a :class:`~._hub_protocol.Refusal` and a sentence for its log), or none."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from . import _hub_protocol as wire
from ._hub_member import Member

__all__ = ["refusal", "refused"]


def refusal(
    info: dict[str, Any],
    *,
    version: str,
    terms: Mapping[str, Any],
    node_ranks: AbstractSet[int],
    awaited: AbstractSet[int],
    nodes: Sequence[Member],
    ready: bool,
) -> tuple[wire.Refusal, str] | None:
    """Why the member that sent ``info`` (its ``JOIN``) cannot be admitted now; None if it can.

    The hub's admission state: its ``version``, the ``terms`` of its job, the job's
    ``node_ranks``, those ``awaited`` now, the ``nodes`` that joined so far, and whether every
    rank is ``ready``.
    """
    rank = info.get("node_rank")
    hostname, pid, expects = info.get("hostname"), info.get("pid"), info.get("expects", {})
    if (
        type(rank) is not int
        or not isinstance(hostname, str)
        or type(pid) is not int
        or not isinstance(expects, dict)
        or not isinstance(info.get("node_id", ""), str)
        or not isinstance(info.get("address", ""), str)
        or type(info.get("port", 0)) is not int
    ):
        shown = repr(info)
        shown = shown if len(shown) <= 200 else shown[:200] + "..."
        return wire.Refusal.MALFORMED, f"a malformed join request {shown}"
    if info.get("version") != version:
        return wire.Refusal.VERSION, (
            f"node rank {rank} runs version {info.get('version')}, the driver "
            f"{version}: install the same versions on every node"
        )
    differ = {key: value for key, value in expects.items() if key in terms and terms[key] != value}
    if differ:
        theirs = ", ".join(f"{key}={value!r}" for key, value in differ.items())
        ours = ", ".join(f"{key}={terms[key]!r}" for key in differ)
        return wire.Refusal.MISMATCH, (
            f"node rank {rank} was started for {theirs}, and this executor has {ours}"
        )
    if rank not in node_ranks:
        job = ", ".join(f"{key}={value!r}" for key, value in terms.items())
        return wire.Refusal.OUT_OF_RANGE, (
            f"node rank {rank} is out of range: this executor's members have node rank(s) "
            f"{_ranks_text(node_ranks)}" + (f" ({job})" if job else "")
        )
    if rank in awaited:
        return None
    holder = next((n for n in nodes if n.node_rank == rank and not n.lost and not n.done), None)
    if holder is not None:
        if awaited:
            state = f"the executor still awaits node rank(s) {_ranks_text(awaited)}"
        elif ready:
            state = "the executor is running and awaits no member"
        else:
            state = "the executor is starting its workers and awaits no member"
        return wire.Refusal.TAKEN, (
            f"node rank {rank} has joined already (member pid {holder.pid} on "
            f"{holder.hostname}); {state}"
        )
    gone = next((n for n in nodes if n.node_rank == rank), None)
    if gone is not None and gone.done:
        why = "its member has stopped its workers: the executor is shutting down"
    elif gone is not None:
        why = "its member was lost, and the executor awaits no other member for it"
    else:
        why = "the executor awaits no member for it"
    return wire.Refusal.NOT_AWAITED, f"node rank {rank} is not awaited: {why}"


def _ranks_text(ranks: Iterable[int]) -> str:
    """``1 to 3`` for a run of ranks, else ``[1, 4]``."""
    ordered = sorted(ranks)
    if len(ordered) == 1:
        return str(ordered[0])
    if ordered and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]} to {ordered[-1]}"
    return str(ordered)


def refused(refusal: wire.Refusal, reason: str, awaited: Iterable[int]) -> list[bytes]:
    """The ``REFUSED`` answer: the reason, the refusal and the node ranks awaited now."""
    payload = {"reason": reason, "refusal": refusal.value, "awaited": sorted(awaited)}
    return wire.control(wire.REFUSED, payload)
