"""One node's rings: the writer's side (:class:`NodeRings`) and a worker's (:class:`WorkerRings`).

A node's workers read every call from one broadcast ring and each answers through a reply
ring of its own, all in one shared-memory segment, with eventfd doorbells both ways. The
writer (the driver, or the agent of another node) makes them; a worker attaches with the
descriptors it inherited or received.

A worker's side of a call: read it, run it through the core's wrapper, answer.
:func:`serve_rings` is the loop of a worker fed by a node's rings;
:func:`decode_call` and :func:`reply_frame` are its steps, for a worker fed otherwise, and
:func:`answer_call` both of them around the handler, for a worker fed one call frame at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from executor_core import WorkerError
from executor_core.backend import RemoteFailure, method_name

from .._codec import (
    KIND_REPLY,
    KIND_STOP,
    STREAM_CHUNK,
    DecodeError,
    Frame,
    copied_whole,
    decode,
    encode,
    plan_assembly,
)
from .doorbell import Doorbell
from .ring import Received, Ring, RingLayout
from .segment import SharedSegment
from .slot_views import SlotViews
from .spin import Spinner

__all__ = [
    "Handler",
    "NodeRings",
    "Reply",
    "RingSizes",
    "SegmentLayout",
    "WorkerFds",
    "WorkerRings",
    "answer_call",
    "decode_call",
    "decode_reply",
    "reply_frame",
    "serve_rings",
]

#: ``handle(method, args, kwargs, reply_rank)``: None if this rank does not answer, else
#: ``(ok, value)``, as :meth:`WorkerWrapper.handle <executor_core.backend.WorkerWrapper.handle>`.
Handler = Callable[[Any, Any, Any, "int | None"], "tuple[bool, Any] | None"]


def decode_call(view: Received) -> tuple[int, int, int | None, Any]:
    """``(kind, seq, reply_rank, body)``; ``reply_rank`` is None for every rank (-1 on the
    wire), and a body that cannot be unpickled is a RemoteFailure."""
    try:
        kind, _ok, reply_rank, seq, body = decode(view)
    except DecodeError as exc:  # reported to the driver as this call's failure
        failure = RemoteFailure.capture(-1, "<decode>", exc.cause)
        return exc.kind, exc.seq, None, failure
    return kind, seq, None if reply_rank < 0 else reply_rank, body


def reply_frame(rank: int, seq: int, method: Any, ok: bool, value: Any) -> Frame:
    try:
        return encode(KIND_REPLY, ok, rank, seq, value)
    except Exception as exc:  # noqa: BLE001 - an unpicklable result becomes the call's error
        # The method's name is only needed here, so it is not worked out on every call.
        name = method if isinstance(method, str) else "<callable>"
        failure = RemoteFailure.capture(rank, name, exc)
        return encode(KIND_REPLY, False, rank, seq, failure)


def answer_call(handle: Handler, rank: int, frame: Received) -> Frame | None:
    """The reply to one call frame (None if this rank does not answer): a call that cannot be
    unpickled, or whose handler raises, is answered with its failure."""
    _kind, seq, reply_rank, body = decode_call(frame)
    if isinstance(body, RemoteFailure):  # the call could not be unpickled here
        return reply_frame(rank, seq, "<decode>", False, attrs.evolve(body, rank=rank))
    method: Any = "<call>"
    try:
        method, args, kwargs = body
        answer = handle(method, args, kwargs, reply_rank)
    except Exception as exc:  # noqa: BLE001 - the call's failure, shipped to the driver
        answer = False, RemoteFailure.capture(rank, method_name(method), exc)
    return None if answer is None else reply_frame(rank, seq, method, *answer)


def serve_rings(handle: Handler, calls: Ring, replies: Ring, rank: int) -> None:
    """Run calls from the broadcast ring until the stop message; answer as ``handle`` says
    (:meth:`WorkerWrapper.handle <executor_core.backend.WorkerWrapper.handle>`, or a
    function with its signature: it knows which ranks answer).

    A call is read in place where the ring allows it (:meth:`Ring.read_held
    <.ring.Ring.read_held>`): its slot is freed once the call has been answered
    and its arguments dropped."""
    read, write, release = calls.read_held, replies.write, calls.release_held
    while True:
        item = read(decode_call, None, plan_assembly)
        kind, seq, reply_rank, body = item
        if kind == KIND_STOP:
            del item, body
            release()
            return
        if isinstance(body, RemoteFailure):
            failure = attrs.evolve(body, rank=rank)
            del item, body
            release()
            write(*reply_frame(rank, seq, "<decode>", False, failure))
            continue
        method, args, kwargs = body
        reply = handle(method, args, kwargs, reply_rank)
        if reply is not None:
            parts, nbytes = reply_frame(rank, seq, method, *reply)
            write(parts, nbytes, copied=True)  # the driver copies what it reads
            del parts
        # Drop this call's arguments and result now: its slot is freed only once nothing
        # refers to it, and an idle worker must not keep the last call's memory (a large
        # payload, a cached receive buffer) until the next one.
        del item, body, method, args, kwargs, reply
        release()


@attrs.frozen(kw_only=True)
class RingSizes:
    """How big a node's rings are, and how long their readers and writers spin."""

    #: Slots in the broadcast ring.
    slots: int
    #: Bytes per broadcast slot (a bigger message streams through several).
    slot_bytes: int
    #: Slots in each worker's reply ring.
    reply_slots: int
    #: Bytes per reply slot.
    reply_slot_bytes: int
    #: Seconds a waiting reader or writer spins before it sleeps on a doorbell.
    spin_s: float


@attrs.frozen(kw_only=True)
class WorkerFds:
    """The descriptors of one worker's view of a node's rings."""

    segment: int
    #: This worker's call doorbell, and the shared "a call slot is free" doorbell.
    call_bell: int
    call_space_bell: int
    #: The writer's reply doorbell, and this worker's "a reply slot is free" doorbell.
    reply_bell: int
    reply_space_bell: int

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        return (
            self.segment,
            self.call_bell,
            self.call_space_bell,
            self.reply_bell,
            self.reply_space_bell,
        )


@attrs.frozen
class SegmentLayout:
    """The broadcast ring and one reply ring per worker, back to back in one segment."""

    broadcast: RingLayout
    replies: tuple[RingLayout, ...]

    @property
    def nbytes(self) -> int:
        last = self.replies[-1]
        return last.offset + last.nbytes

    @classmethod
    def build(
        cls, workers: int, slots: int, slot_bytes: int, reply_slots: int, reply_slot_bytes: int
    ) -> SegmentLayout:
        broadcast = RingLayout(0, workers, slots, slot_bytes)
        replies = []
        offset = broadcast.nbytes
        for _ in range(workers):
            ring = RingLayout(offset, 1, reply_slots, reply_slot_bytes)
            replies.append(ring)
            offset += ring.nbytes
        return cls(broadcast, tuple(replies))


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


class NodeRings:
    """The segment, rings and doorbells that feed one node's workers, as their writer (the
    driver, or a node agent) holds them: a broadcast ring of calls that every worker reads,
    and a reply ring per worker.

    Every descriptor and the mapping are handed to ``add_cleanup`` as they are made, so they
    are released (after the workers stopped and every reader left) whatever fails later.
    """

    def __init__(
        self,
        workers: int,
        sizes: RingSizes,
        add_cleanup: Callable[[Callable[[], None]], None],
    ) -> None:
        layout = SegmentLayout.build(
            workers, sizes.slots, sizes.slot_bytes, sizes.reply_slots, sizes.reply_slot_bytes
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
        spin = Spinner(sizes.spin_s)  # one budget for the writer's waits
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
                ends_bulk=False,
            )
            for rank, ring in enumerate(layout.replies)
        ]

    def write_call(
        self,
        parts: Sequence[Any],
        nbytes: int,
        deadline: float | None,
        abort: Callable[[], None],
        finish_by: float | None = None,
    ) -> bool:
        """Write a call's frame (``nbytes`` in ``parts``) to every worker, as
        :meth:`Ring.write <.ring.Ring.write>` does; one whose workers copy every byte of it
        anyway (no tensor or array built in place: see
        :func:`~.._codec.copied_whole`) streams
        even if it fits one slot."""
        copied = nbytes > STREAM_CHUNK and copied_whole(parts[0], nbytes)
        return self.calls.write(parts, nbytes, deadline, abort, finish_by=finish_by, copied=copied)

    def worker_fds(self, index: int) -> WorkerFds:
        """The descriptors worker ``index`` needs (to inherit, or to receive over a Unix
        socket): see :meth:`WorkerRings.attach`."""
        return WorkerFds(
            segment=self.segment.fd,
            call_bell=self.call_bells[index].fd,
            call_space_bell=self.call_space.fd,
            reply_bell=self.reply_bell.fd,
            reply_space_bell=self.reply_spaces[index].fd,
        )

    def resume_worker(self, index: int) -> None:
        """Worker ``index``'s process is gone and another takes its place (rank replacement):
        it will read calls from the next one written, and write replies into an empty reply
        ring (a call withdrawn part-way, which the others still hold part of, it skips)."""
        self.calls.resume_reader(index)
        self.replies[index].resume_reader(0)

    @property
    def broken(self) -> bool:
        """True if a reply of several slots was left half-read (a send never breaks them)."""
        return any(ring.broken for ring in self.replies)

    def wake(self) -> None:
        """Wake the driver's waits: for a reply, and for a free call slot."""
        with contextlib.suppress(OSError):
            self.reply_bell.ring()
            self.call_space.ring()


class WorkerRings:
    """A worker's end of its node's rings: it reads calls and writes its replies."""

    def __init__(self, segment: SharedSegment, calls: Ring, replies: Ring) -> None:
        self.segment = segment
        self.calls = calls
        self.replies = replies

    @classmethod
    def attach(
        cls,
        fds: WorkerFds,
        layout: SegmentLayout,
        index: int,
        spin_s: float,
        idle_spin_s: float,
    ) -> WorkerRings:
        """Map the segment and wrap the doorbells given as ``fds`` (they now belong to the
        returned object's process), as worker ``index`` of the node. The worker spins
        ``idle_spin_s`` for its next call before it sleeps, ``spin_s`` in its other waits."""
        segment = SharedSegment.attach(fds.segment, layout.nbytes)
        spin = Spinner(spin_s)  # one budget for the process: contention is per machine
        calls = Ring(
            segment.buf,
            layout.broadcast,
            reader=index,
            data_bells=[Doorbell(fds.call_bell, blocking=True)],
            space_bell=Doorbell(fds.call_space_bell),
            spin=spin,
            wait_spin_s=max(idle_spin_s, spin_s),  # 0: only ``spin_s``
            # Calls are read in place: a tensor argument is not copied out of its slot.
            views=SlotViews.open(fds.segment, layout.broadcast),
        )
        replies = Ring(
            segment.buf,
            layout.replies[index],
            reader=None,
            data_bells=[Doorbell(fds.reply_bell)],
            space_bell=Doorbell(fds.reply_space_bell),
            spin=spin,
            ends_bulk=False,
        )
        return cls(segment, calls, replies)
