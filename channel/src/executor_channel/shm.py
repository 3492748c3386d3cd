"""The channel within one node: rings of slots in a shared-memory segment, woken by doorbells.

For backends whose workers share the driver's machine. A :class:`SharedSegment` holds one or
more :class:`Ring` objects (one writer, any number of readers, each message copied once in;
a reader copies it out, or, for a worker's call of one slot, reads it in place through
copy-on-write views of its own); a reader or writer that finds nothing to do spins briefly under a
:class:`Spinner`, then sleeps on a :class:`Doorbell` (an eventfd), so idle processes use no
CPU. What goes into a ring is a frame of :mod:`executor_channel.codec`. :class:`NodeRings`
(the writer's) and :class:`WorkerRings` (a worker's) are one node's set: a broadcast ring of
calls and a reply ring per worker; :func:`serve_rings` is a worker's loop over them. Large
messages are received into warm memory that the process gives back once idle
(:func:`release_receive_buffers` at once; from a thread that waits anyway, an :class:`IdleTrim`,
or :func:`trim_receive_buffers` from a loop that wakes every second or so).
"""

from __future__ import annotations

from ._buffers import IdleTrim
from ._buffers import release as release_receive_buffers
from ._buffers import trim_if_due as trim_receive_buffers
from ._doorbell import Doorbell
from ._node_rings import (
    NodeRings,
    RingSizes,
    SegmentLayout,
    WorkerFds,
    WorkerRings,
)
from ._ring import Received, Ring, RingAbortedError, RingLayout
from ._segment import SharedSegment
from ._serve import Handler, serve_rings
from ._spin import Spinner

__all__ = [
    "Doorbell",
    "Handler",
    "IdleTrim",
    "NodeRings",
    "Received",
    "Ring",
    "RingAbortedError",
    "RingLayout",
    "RingSizes",
    "SegmentLayout",
    "SharedSegment",
    "Spinner",
    "WorkerFds",
    "WorkerRings",
    "release_receive_buffers",
    "serve_rings",
    "trim_receive_buffers",
]
