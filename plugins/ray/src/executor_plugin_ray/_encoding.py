"""How calls and replies cross Ray: as bytes pickled here when that is cheaper.

Ray passes a ``bytes`` argument or result as is, but runs anything else through its own
serializer (msgpack, with cloudpickle for what msgpack cannot hold), which costs tens of
microseconds more per message on small values (measured: a call with one small list
argument took about 50 µs longer than one with a bytes argument, and a small dict result
about 100 µs longer than the same dict pickled to bytes; Ray 2.60, 2 cores). So small calls
and results are pickled with cloudpickle (which, as Ray's serializer does, handles lambdas
and classes defined in ``__main__``) and cross as bytes. Values that Ray handles better are
left to Ray: those holding Ray object refs or actor handles (Ray counts references to them)
and those with buffers that pickle keeps out of band (numpy arrays: Ray stores them without
a copy).

Both ends are this executor's own processes, in a Ray cluster that already unpickles what
crosses it; nothing here reads bytes from anyone else.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import attrs
import cloudpickle
import ray
from ray.actor import ActorHandle

from executor_core.backend import RemoteFailure

__all__ = [
    "LIFT_BYTES",
    "Carried",
    "Failed",
    "decode_call",
    "decode_reply",
    "encode_call",
    "encode_reply",
    "pack",
    "reply_of",
]

#: Types that must go through Ray's serializer, which tracks references to them.
_RAY_HANDLES: tuple[type, ...] = (ray.ObjectRef, ActorHandle)
#: Arguments at least this large cross as arguments of their own, put into the object store
#: once for all workers rather than serialised once per worker (Ray inlines smaller ones).
LIFT_BYTES = 100 * 1024


@attrs.frozen
class Failed:
    """A worker's failure as a reply."""

    failure: RemoteFailure


@attrs.frozen
class Carried:
    """A result left to Ray's serializer (see the module docstring)."""

    value: Any


class _LeaveToRay(Exception):
    """Raised while pickling when Ray's serializer should carry the value."""


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle ships no types
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, _RAY_HANDLES):
            raise _LeaveToRay
        return super().reducer_override(obj)


def pack(value: Any) -> bytes | None:
    """``value`` pickled, or ``None`` when Ray's serializer should carry it instead.

    ``None`` also when pickling fails: Ray's serializer then raises its own error, or
    succeeds where this one could not.
    """
    stream = io.BytesIO()
    out_of_band: list[pickle.PickleBuffer] = []
    try:
        _Pickler(stream, protocol=5, buffer_callback=out_of_band.append).dump(value)
    except Exception:  # noqa: BLE001 - not an error: Ray's serializer decides (see docstring)
        return None
    if out_of_band:
        return None
    return stream.getvalue()


def encode_call(
    wire: str | bytes,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    reply_rank: int | None,
    world_size: int,
) -> tuple[Any, list[Any]]:
    """The call for ``RayWorker.execute`` (see ``_actor.WireCall``) and the arguments lifted
    out of it.

    Positional arguments of :data:`LIFT_BYTES` or more (bytes, arrays, tensors) become
    arguments of the Ray call itself, which Ray stores as it would for a plain actor call
    (bytes without a copy into a message); with several workers each is put into the object
    store once for all of them. The rest is pickled to bytes when it can be (:func:`pack`),
    else left to Ray's serializer, and put once too when large. A call that comes back as
    bytes with nothing lifted may also go on the direct sockets.
    """
    positions = [i for i, value in enumerate(args) if _nbytes(value) >= LIFT_BYTES]
    rest: list[Any] = list(args)
    lifted: list[Any] = []
    for i in positions:
        lifted.append(rest[i])
        rest[i] = None
    if world_size > 1:
        lifted = [ray.put(value) for value in lifted]  # Ray resolves top-level refs
    call: Any = [wire, rest, kwargs, reply_rank, positions]  # lists: see _actor.WireCall
    kwargs_nbytes = sum(_nbytes(v) for v in (kwargs or {}).values())
    if kwargs_nbytes < LIFT_BYTES:
        return pack(call) or call, lifted
    if world_size > 1:
        call = ray.put(call)
    return call, lifted


def _nbytes(value: Any) -> int:
    """The size of a buffer (bytes, str, array, tensor, memoryview); 0 for anything else."""
    if isinstance(value, bytes | bytearray | str):
        return len(value)
    nbytes = getattr(value, "nbytes", None)  # numpy arrays, torch tensors, memoryviews
    return nbytes if isinstance(nbytes, int) else 0


def decode_call(call: Any) -> Any:
    """The call as the driver built it (see :func:`pack`)."""
    if type(call) is bytes:
        return pickle.loads(call)
    return call


def reply_of(handled: tuple[bool, Any] | None) -> Any:
    """What ``WorkerWrapper.handle`` returned, as a reply: ``None`` (this rank need not
    answer), the result, or a :class:`Failed`."""
    if handled is None:
        return None
    ok, value = handled
    return value if ok else Failed(value)


def encode_reply(reply: Any) -> Any:
    """A worker's reply for Ray: ``None``, a :class:`Failed`, pickled bytes or
    :class:`Carried`."""
    if reply is None or isinstance(reply, Failed):
        return reply
    data = pack(reply)
    return Carried(reply) if data is None else data


def decode_reply(reply: Any) -> Any:
    """The result in a reply from :func:`encode_reply` (a :class:`Failed` is returned as is)."""
    if type(reply) is bytes:
        return pickle.loads(reply)
    if isinstance(reply, Carried):
        return reply.value
    return reply
