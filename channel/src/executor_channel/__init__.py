"""executor-channel: how an Executor SDK backend carries calls to workers out of its process.

One public module, three parts:

- **Within a node** (``_shm/``), shared memory: a :class:`NodeRings` holds a broadcast ring
  of calls and a reply ring per worker; a worker attaches its :class:`WorkerRings` (from its
  :class:`WorkerFds` and :class:`SegmentLayout`) and runs :func:`serve_rings`. Waits spin
  briefly, then sleep on a :class:`Doorbell` (an eventfd).
- **Between nodes** (``_net/``), authenticated links: a :class:`Listener` (zmq ROUTER, on
  loopback unless told otherwise) and the :class:`Connection` objects that dial it exchange
  messages of bytes-like parts. Every frame carries a MAC under keys derived from a shared
  :class:`Secret` and is checked (structure, lengths, MAC, freshness) before the caller sees a
  byte of it; frames that fail are dropped, counted per :class:`DropReason` and logged once
  per peer, within the :class:`Limits`. The link never unpickles. A :class:`Hub` is the
  driver's side: members (node agents, or a :class:`MemberServer` serving one rank itself)
  join it and speak its protocol (:class:`Op`; a refused join says why, :class:`Refusal`).
  Frames are authenticated, not encrypted; see ``docs/security.md``.
- **The codec** (``_codec.py``): pickle protocol 5 with out-of-band buffers (CPU tensors,
  numpy arrays and large ``bytes`` travel beside the pickle stream); :func:`encode` makes a
  frame of a :class:`Kind`. Large messages are copied into warm receive memory
  (``_memory/``), which :class:`IdleTrim` gives back when idle.

:class:`ChannelTransport` is the driver's end, the base of ``mp``'s and ``ray``'s transports;
:class:`ChannelOptions`, the options they share. Errors: :class:`ChannelError`,
:class:`ChannelTimeoutError`, :class:`SecretError`. Hostile-peer test helpers:
:mod:`executor_channel.testing`.
"""

from __future__ import annotations

from ._codec import Kind, encode
from ._driver import ChannelTransport
from ._memory.buffers import IdleTrim
from ._net.hub_protocol import Op, Refusal
from ._net.secret import Secret, SecretError
from ._options import ChannelOptions
from ._shm.doorbell import Doorbell
from ._shm.node_rings import NodeRings, SegmentLayout, WorkerFds, WorkerRings, serve_rings
from ._shm.ring import Received

# Not typing.TYPE_CHECKING (importing typing costs time here); type checkers treat any
# constant of this name as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._net.connection import Connection
    from ._net.frames import DropReason, Limits
    from ._net.hub import Hub
    from ._net.link import ChannelError, ChannelTimeoutError
    from ._net.listener import Listener
    from ._net.member import MemberServer

#: The names of the links between nodes, imported on first use: they import zmq and
#: cryptography, which a process whose ranks are all on one node never needs (its workers
#: start without them: ``test_one_node_never_imports_zmq``).
_BETWEEN_NODES = {
    "ChannelError": "._net.link",
    "ChannelTimeoutError": "._net.link",
    "Connection": "._net.connection",
    "DropReason": "._net.frames",
    "Hub": "._net.hub",
    "Limits": "._net.frames",
    "Listener": "._net.listener",
    "MemberServer": "._net.member",
}

__all__ = [
    "ChannelError",
    "ChannelOptions",
    "ChannelTimeoutError",
    "ChannelTransport",
    "Connection",
    "Doorbell",
    "DropReason",
    "Hub",
    "IdleTrim",
    "Kind",
    "Limits",
    "Listener",
    "MemberServer",
    "NodeRings",
    "Op",
    "Received",
    "Refusal",
    "Secret",
    "SecretError",
    "SegmentLayout",
    "WorkerFds",
    "WorkerRings",
    "__version__",
    "encode",
    "serve_rings",
]

__version__ = "0.1.0"  # the one source of the distribution's version (pyproject reads it)

# Hidden from type checkers, which then check every name against the imports above.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> object:
        module = _BETWEEN_NODES.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        import importlib

        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value
        return value
