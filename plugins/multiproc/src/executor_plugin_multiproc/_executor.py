"""MultiprocExecutor: one worker process per rank on this machine."""

from __future__ import annotations

from typing import ClassVar

from executor_core import Executor
from executor_core.backend import Transport

from ._options import MultiprocOptions
from ._transport import MultiprocTransport

__all__ = ["MultiprocExecutor"]


class MultiprocExecutor(Executor):
    """Runs one worker process per rank on this machine (backend ``"mp"``).

    Each call is written once into a shared-memory ring that every worker reads; each worker
    answers through its own shared-memory reply ring (see :class:`MultiprocTransport`). Every
    rule of a call (ordering, timeouts, reply gathering, failure, shutdown) is the core's. See
    the distribution's README for the ``backend_options`` keys.
    """

    transport_cls: ClassVar[type[Transport]] = MultiprocTransport
    #: The backend_options it takes (the core refuses any other key).
    options_cls = MultiprocOptions
