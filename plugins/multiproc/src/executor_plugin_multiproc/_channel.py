"""The driver's end of the shared-memory channel: one segment holding the broadcast ring (the
driver writes, every worker reads) and one reply ring per worker (the worker writes, the
driver reads), and the eventfd doorbells of both directions."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from executor_channel.codec import DecodeError, decode
from executor_channel.shm import Doorbell, Received, Ring, SharedSegment, Spinner
from executor_core import WorkerError

from ._options import MultiprocOptions
from ._process import InheritedFd, SegmentLayout

__all__ = ["DriverChannel", "Reply", "decode_reply"]

#: kind, seq, rank, ok, value (a RemoteFailure or a WorkerError when not ok)
Reply = tuple[int, int, int, bool, Any]


def decode_reply(view: Received) -> Reply:
    """A reply frame; one whose body cannot be unpickled becomes that rank's WorkerError."""
    try:
        kind, ok, rank, seq, body = decode(view)
    except DecodeError as exc:  # becomes this call's error; the executor goes on
        error = WorkerError(
            exc.rank,
            "<reply>",
            type(exc.cause).__name__,
            f"the driver could not unpickle the reply of rank {exc.rank}: {exc.cause}",
            "",
            exc.cause,
        )
        return exc.kind, exc.seq, exc.rank, False, error
    return kind, seq, rank, ok, body


class DriverChannel:
    """The segment, rings and doorbells of one executor, as the driver holds them.

    Every descriptor and the mapping are handed to ``add_cleanup`` as they are made, so they
    are released (after the workers stopped and every reader left) whatever fails later.
    """

    def __init__(
        self,
        workers: int,
        options: MultiprocOptions,
        add_cleanup: Callable[[Callable[[], None]], None],
    ) -> None:
        layout = SegmentLayout.build(
            workers, options.slots, options.slot_bytes, options.reply_slots, options.reply_bytes
        )
        self.layout = layout
        segment = SharedSegment.create(layout.nbytes)
        add_cleanup(segment.close)
        self.segment = segment
        # The calls' doorbells (one per worker: each blocks in a read on its own) and the
        # "a call slot is free" one; the replies' doorbell and each worker's "a reply slot
        # is free" one.
        self.call_bells = [Doorbell(blocking=True) for _ in range(workers)]
        self.call_space = Doorbell()
        self.reply_bell = Doorbell(blocking=True)
        self.reply_spaces = [Doorbell() for _ in range(workers)]
        for bell in (*self.call_bells, self.call_space, self.reply_bell, *self.reply_spaces):
            add_cleanup(bell.close)
        spin = Spinner(options.spin_s)  # one budget for the driver's waits
        self.spinner = spin
        self.calls = Ring(
            segment.buf,
            layout.broadcast,
            reader=None,
            data_bells=self.call_bells,
            space_bell=self.call_space,
            spin=spin,
        )
        self.replies = [
            Ring(
                segment.buf,
                ring,
                reader=0,
                data_bells=[self.reply_bell],
                space_bell=self.reply_spaces[rank],
                spin=spin,
            )
            for rank, ring in enumerate(layout.replies)
        ]

    def worker_fds(self, rank: int) -> dict[str, InheritedFd]:
        """The descriptors worker ``rank`` inherits (``WorkerSpec`` fields)."""
        return {
            "segment": InheritedFd(self.segment.fd),
            "call_bell": InheritedFd(self.call_bells[rank].fd),
            "call_space_bell": InheritedFd(self.call_space.fd),
            "reply_bell": InheritedFd(self.reply_bell.fd),
            "reply_space_bell": InheritedFd(self.reply_spaces[rank].fd),
        }

    @property
    def broken(self) -> bool:
        """True if a transfer spanning several slots was interrupted half-way."""
        return self.calls.broken or any(ring.broken for ring in self.replies)

    def wake(self) -> None:
        """Wake the driver's waits: for a reply, and for a free call slot."""
        with contextlib.suppress(OSError):
            self.reply_bell.ring()
            self.call_space.ring()
