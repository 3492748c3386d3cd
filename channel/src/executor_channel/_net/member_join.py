"""A member's start-up on its link to the hub (:func:`join_hub`): ``JOIN``, the hub's answer
(the ``SPEC``, whose content a member ignores, or why it refuses), the owner's ``prepare``,
then the ready frame of the member's rank (or its failure to prepare).

:class:`~.member.MemberServer`'s constructor runs it on the link it has just dialed: its
thread owns the link until serving starts.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

from executor_core.backend import RemoteFailure

from .._codec import KIND_READY, encode
from .connection import Connection
from .hub_protocol import Op
from .link import ChannelError, ChannelTimeoutError

__all__ = ["join_hub"]


def join_hub(
    link: Connection,
    rank: int,
    version: str,
    join_timeout: float,
    prepare: Callable[[], None] | None,
) -> None:
    """Join the hub over ``link`` as node rank ``rank`` saying ``version``, wait up to
    ``join_timeout`` for its spec, run ``prepare`` (if given), and announce ``rank`` ready, or
    its failure to prepare (then raise :class:`~.link.ChannelError`).

    Raises :class:`~.link.ChannelTimeoutError` if no spec comes in time, and
    :class:`~.link.ChannelError` if the hub refuses this member or gives up (``KILL``)."""
    link.send(
        Op.frame(
            Op.JOIN,
            {
                "node_rank": rank,
                "hostname": socket.gethostname(),
                "pid": os.getpid(),
                "version": version,
            },
        ),
        timeout=join_timeout,
    )
    try:
        message = link.recv(join_timeout)
    except ChannelTimeoutError:
        raise ChannelTimeoutError(
            f"the driver at {link.address} sent no spec for rank {rank} within {join_timeout:g} s"
        ) from None
    op = bytes(message.parts[0]) if message.parts else b""
    if op == Op.REFUSED:
        reason = Op.read(message.parts).get("reason", "?")
        raise ChannelError(f"the driver refused rank {rank}: {reason}")
    if op == Op.KILL:
        raise ChannelError(f"the driver gave up before rank {rank} started")
    if op != Op.SPEC:
        raise ChannelError(f"the driver sent {op!r} instead of rank {rank}'s spec")
    # The spec's content is for node agents; a member serves the rank it joined as.
    failure: RemoteFailure | None = None
    if prepare is not None:
        try:
            prepare()
        except Exception as exc:  # noqa: BLE001 - reported to the driver, then raised
            failure = RemoteFailure.capture(rank, "prepare", exc)
    ready = (True, os.getpid()) if failure is None else (False, failure)
    frame = encode(KIND_READY, ready[0], rank, 0, ready[1])
    link.send([Op.FRAME, b"".join(frame[0])], timeout=join_timeout)
    if failure is not None:
        raise ChannelError(
            f"rank {rank} failed to start (the driver was told): "
            f"{failure.exc_type}: {failure.message}"
        )
