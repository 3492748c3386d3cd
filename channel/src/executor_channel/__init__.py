"""executor-channel: how an Executor SDK backend carries calls to workers out of its process.

One public module, three parts:

- **Within a node**, shared memory: a :class:`NodeRings` (the driver's, or a node agent's)
  holds a broadcast ring of calls and a reply ring per worker in one segment; each
  worker attaches its :class:`WorkerRings` (from the :class:`WorkerFds` and the
  :class:`SegmentLayout` it was handed) and runs :func:`serve_rings`. A ring's waits spin
  briefly, then sleep on a :class:`Doorbell` (an eventfd), so idle processes use no CPU. Large
  messages are received into warm memory that the process gives back once idle
  (:class:`IdleTrim`).
- **Between nodes**, authenticated links: a :class:`Listener` (zmq ROUTER, on loopback unless
  told otherwise) and the :class:`Connection` objects that dial it exchange messages of bytes-
  like parts. Every frame carries a MAC under keys derived from a shared :class:`Secret` and
  is checked (structure, lengths, MAC, freshness) before the caller sees a byte of it; frames
  that fail are dropped, counted per :class:`DropReason` and logged once per peer, within the
  :class:`Limits`. The link never unpickles. A :class:`Hub` is the driver's side: members
  (node agents, or a :class:`MemberServer` serving one rank itself) join it and speak its
  protocol (:class:`Op`; a refused join says why, :class:`Refusal`). Frames are authenticated,
  not encrypted; see ``docs/security.md``.
- **The codec**: pickle protocol 5 with out-of-band buffers (CPU tensors, numpy arrays and
  large ``bytes`` travel beside the pickle stream); :func:`encode` makes a frame of a
  :class:`Kind`.

:class:`ChannelTransport` is the driver's end, the base of a backend whose workers run out of
process (``mp``, ``ray``): it sends each call to every rank (the rings of this machine, the
hub of the others) and hands their replies to the core; :class:`ChannelOptions` are the
options every such backend shares. Errors: :class:`ChannelError`,
:class:`ChannelTimeoutError`, :class:`SecretError`. Helpers for hostile-peer tests live in
:mod:`executor_channel.testing`.
"""

from __future__ import annotations

from ._buffers import IdleTrim
from ._codec import Kind, encode
from ._connection import Connection
from ._doorbell import Doorbell
from ._driver import ChannelTransport
from ._frames import DropReason, Limits
from ._hub import Hub
from ._hub_protocol import Op, Refusal
from ._link import ChannelError, ChannelTimeoutError
from ._listener import Listener
from ._member import MemberServer
from ._node_rings import NodeRings, SegmentLayout, WorkerFds, WorkerRings, serve_rings
from ._options import ChannelOptions
from ._ring import Received
from ._secret import Secret, SecretError

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
