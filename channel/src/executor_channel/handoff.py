"""Handing a node's rings to workers that are not the writer's children (Ray actors, say).

The writer offers each worker its descriptors (:class:`~executor_channel.shm.WorkerFds`) on
an abstract Unix socket; a worker that proves it holds the per-executor key, and runs as the
same user, receives them (SCM_RIGHTS) with :func:`receive_fds`. Nothing is unpickled.
"""

from __future__ import annotations

from ._handoff_client import HandoffError, HandoffTimeoutError, receive_fds
from ._handoff_server import RingHandoff

__all__ = [
    "HandoffError",
    "HandoffTimeoutError",
    "RingHandoff",
    "receive_fds",
]
