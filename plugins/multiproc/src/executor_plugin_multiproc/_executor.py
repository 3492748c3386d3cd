"""MultiprocExecutor: one worker process per rank, on this machine and on node agents."""

from __future__ import annotations

from typing import ClassVar

from executor_core import Executor
from executor_core.backend import Transport, TransportHost

from ._options import MultiprocOptions
from ._transport import MultiprocTransport
from .launcher import ManualPlacement, Placement

__all__ = ["MultiprocExecutor"]


class MultiprocExecutor(Executor):
    """Runs one worker process per rank (backend ``"mp"``): on this machine, and with
    ``num_nodes > 1`` on the other nodes' agents (``executor node``).

    Each call is written once into a shared-memory ring that every worker of a node reads;
    each worker answers through its own shared-memory reply ring (see
    :class:`MultiprocTransport`). Every rule of a call (ordering, timeouts, reply gathering,
    failure, shutdown) is the core's. See the distribution's README for the
    ``backend_options`` keys.

    A backend that starts the agents through its own scheduler subclasses this class and
    sets :attr:`placement_cls` (see :mod:`executor_plugin_multiproc.launcher`).
    """

    transport_cls: ClassVar[type[Transport]] = MultiprocTransport
    #: The backend_options it takes (the core refuses any other key).
    options_cls = MultiprocOptions
    #: Where the agents of a multi-node executor run and who starts them: by default
    #: someone else (:class:`~executor_plugin_multiproc.launcher.ManualPlacement`).
    placement_cls: ClassVar[type[Placement]] = ManualPlacement

    @classmethod
    def _create_transport(cls, host: TransportHost) -> Transport:
        options_cls = cls.options_cls
        if not issubclass(options_cls, MultiprocOptions):
            raise TypeError(
                f"{cls.__qualname__}.options_cls must subclass MultiprocOptions (the "
                f"transport reads mp's keys from it), not {options_cls.__qualname__}"
            )
        return MultiprocTransport(host, cls.placement_cls, options_cls)
