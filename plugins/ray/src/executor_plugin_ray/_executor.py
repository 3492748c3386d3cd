"""RayExecutor: one Ray actor per rank, in a placement group, on one node or many."""

from __future__ import annotations

import time
from typing import ClassVar

from executor_core import Executor, RPCTimeoutError
from executor_core.backend import Transport

from ._options import RayOptions
from ._ranks import WorkerPlacement
from ._transport import RayTransport

__all__ = ["RayExecutor"]


class RayExecutor(Executor):
    """Runs each rank's worker in a Ray actor (backend ``"ray"``); see the distribution's
    README for options, and :class:`~._transport.RayTransport` for how calls travel.

    Small calls go on the executor's own socket to each worker when all are on the driver's
    node (or on any node with ``direct_calls_across_nodes``), and as Ray actor tasks
    otherwise. With ``compiled_graph`` enabled ``execute_model`` goes through a Ray Compiled
    Graph. A monitor fails the executor with :class:`~executor_core.WorkerDiedError` (rank
    and node) as soon as Ray reports an actor or its node dead.
    """

    transport_cls: ClassVar[type[Transport]] = RayTransport

    @property
    def transport(self) -> RayTransport:
        transport = self._transport
        assert isinstance(transport, RayTransport)
        return transport

    @property
    def placements(self) -> list[WorkerPlacement]:
        """Each rank's node id, node IP, local rank and actor pid, in rank order."""
        return list(self.transport.placements)

    @property
    def options(self) -> RayOptions:
        """The validated ``backend_options``."""
        return self.transport.options

    @property
    def uses_direct_calls(self) -> bool:
        """True if small calls go on the executor's own sockets (see ``_direct``)."""
        return self.transport.uses_direct_calls

    @property
    def uses_compiled_graph(self) -> bool:
        """True if ``execute_model`` goes through a Ray Compiled Graph."""
        return self.transport.uses_compiled_graph

    @property
    def compiled_graph_live(self) -> bool:
        """True while ``execute_model``'s compiled graph is compiled: its loops then poll on
        every worker (see :meth:`release_compiled_graph`)."""
        return self.transport.compiled_graph_live

    def release_compiled_graph(self, timeout: float | None = None) -> bool:
        """Tear down ``execute_model``'s compiled graph until the next step compiles it again.

        While a compiled graph is live, Ray's loop on each worker polls its input channel
        (spinning, though it yields the CPU), so an idle engine keeps a core per worker busy.
        Call this before a long idle spell; :meth:`sleep` calls it too. The next
        ``execute_model`` compiles the graph again (a fraction of a second). Waits for the
        steps in flight (up to ``timeout``; the executor's ``rpc_timeout`` when ``None``), and
        holds later calls back meanwhile. Returns True if a graph was torn down, False if
        none was live.
        """
        self._check_open()
        timeout = self._resolve_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        # The send lock keeps new steps out while the ones in flight are read.
        if not self._send_lock.acquire(timeout=-1 if timeout is None else timeout):
            raise RPCTimeoutError("release_compiled_graph", range(self.world_size), timeout or 0.0)
        try:
            transport = self.transport
            if not transport.wait_compiled_drained(deadline):
                self._check_open()
                raise RPCTimeoutError(
                    "release_compiled_graph", range(self.world_size), timeout or 0.0
                )
            return transport.release_compiled_graph()
        finally:
            self._send_lock.release()

    def sleep(self, level: int = 1) -> None:
        """As :meth:`Executor.sleep`; first releases the compiled graph (see
        :meth:`release_compiled_graph`), so that a sleeping engine's workers stay idle."""
        self._check_open()
        if level in (1, 2) and self.uses_compiled_graph and not self.sleeping_tags:
            self.release_compiled_graph()
        super().sleep(level)
