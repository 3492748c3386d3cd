"""A worker's side of a call: read it, run it through the core's wrapper, answer.

:func:`serve_rings` is the loop of a worker fed by a node's rings (:mod:`._node_rings`);
:func:`decode_call` and :func:`reply_frame` are its steps, for a worker fed otherwise, and
:func:`answer_call` both of them around the handler, for a worker fed one call frame at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from executor_core.backend import RemoteFailure, method_name

from ._codec import KIND_REPLY, KIND_STOP, DecodeError, Frame, decode, encode, plan_assembly
from ._ring import Received, Ring

__all__ = ["Handler", "answer_call", "decode_call", "reply_frame", "serve_rings"]

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
    <._ring.Ring.read_held>`): its slot is freed once the call has been answered
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
