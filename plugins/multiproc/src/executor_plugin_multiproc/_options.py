"""The ``backend_options`` the mp backend understands, validated into :class:`MultiprocOptions`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from executor_channel.shm import RingSizes
from executor_core.options import integer, number, one_of, option, optional, parse_backend_options

__all__ = ["MultiprocOptions"]

_MIB = 1 << 20


@attrs.frozen(kw_only=True)
class MultiprocOptions:
    """Knobs of the mp backend, read from ``ExecutorConfig.backend_options``."""

    #: How worker processes are started: "spawn" (default), "forkserver", or "fork" (only
    #: safe if the driver has no threads holding locks and no CUDA context yet).
    start_method: str = option("spawn", one_of("spawn", "forkserver", "fork"))
    #: Slots in the broadcast ring (calls that can be queued before the writer waits).
    slots: int = option(4, integer(at_least=2))
    #: Bytes per broadcast slot; a bigger call is streamed through several slots.
    slot_bytes: int = option(16 * _MIB, integer(at_least=4096))
    #: Slots in each worker's reply ring.
    reply_slots: int = option(2, integer(at_least=1))
    #: Bytes per reply slot (default: ``slot_bytes``).
    reply_slot_bytes: int | None = option(None, optional(integer(at_least=4096)))
    #: Seconds a waiting reader or writer spins (yielding the CPU) before it sleeps. A short
    #: spin catches a reply that is microseconds away without two context switches; a
    #: process stops spinning for a while when its yields lose the CPU to other busy
    #: processes (see ``_spin.Spinner``). Figures: docs/benchmarks.md.
    spin_s: float = option(50e-6, number(at_least=0.0, at_most=0.01))
    #: Seconds to wait for every worker to report ready (``init_device`` + ``load_model``).
    startup_timeout: float = option(600.0, number(above=0.0))
    #: Seconds workers get to exit after the stop message before SIGTERM, and again before
    #: SIGKILL.
    shutdown_grace_s: float = option(5.0, number(at_least=0.0))

    #: With ``num_nodes > 1``: the TCP port on which the driver waits for the node agents
    #: (``executor node --master-port``), on ``ExecutorConfig.distributed_host``.
    node_port: int = option(29550, integer(at_least=1, at_most=65535))
    #: With ``num_nodes > 1``: seconds without a heartbeat after which a node (seen from the
    #: driver) or the driver (seen from an agent) counts as lost. Heartbeats go every quarter
    #: of it; an agent that loses its driver stops its workers.
    node_timeout_s: float = option(1.0, number(at_least=0.2, at_most=600.0))

    @property
    def ring_sizes(self) -> RingSizes:
        """The sizes of each node's rings."""
        return RingSizes(
            slots=self.slots,
            slot_bytes=self.slot_bytes,
            reply_slots=self.reply_slots,
            reply_slot_bytes=self.reply_bytes,
            spin_s=self.spin_s,
        )

    @property
    def reply_bytes(self) -> int:
        """Effective bytes per reply slot."""
        return self.reply_slot_bytes if self.reply_slot_bytes is not None else self.slot_bytes

    @classmethod
    def from_backend_options(cls, options: Mapping[str, Any]) -> MultiprocOptions:
        """Validate ``options``; raise :class:`~executor_core.ConfigError` naming the bad key."""
        return parse_backend_options(cls, options, "mp")
