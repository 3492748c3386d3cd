"""The channel's ``backend_options``, shared by every backend that uses the channel.

A backend's options class subclasses :class:`ChannelOptions` (attrs, frozen, keyword-only),
so that the keys, defaults, checks and meaning of the channel's knobs are written once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self

import attrs

from executor_core.options import integer, number, option, optional, parse_backend_options

from ._shm.node_rings import RingSizes

__all__ = ["ChannelOptions"]

_MIB = 1 << 20
#: Room in a default slot for a call's header, method, pickled arguments and the lengths of
#: its out-of-band buffers, beside a payload of a round size.
_FRAMING = 64 << 10


@attrs.frozen(kw_only=True)
class ChannelOptions:
    """Sizes of the driver node's rings, their spinning, and the heartbeat of other nodes."""

    #: Slots in the broadcast ring (calls that can be queued before the writer waits).
    slots: int = option(4, integer(at_least=2))
    #: Bytes per broadcast slot; a bigger call is streamed through several slots. A call of
    #: one slot is read in place, with no copy; a larger one is copied out as it streams. The
    #: default holds a 16 MiB tensor with the rest of its call (``_FRAMING``).
    slot_bytes: int = option(16 * _MIB + _FRAMING, integer(at_least=4096))
    #: Slots in each worker's reply ring.
    reply_slots: int = option(2, integer(at_least=1))
    #: Bytes per reply slot (default: ``slot_bytes``).
    reply_slot_bytes: int | None = option(None, optional(integer(at_least=4096)))
    #: Seconds a waiting reader or writer spins (yielding the CPU) before it sleeps. A short
    #: spin catches a reply that is microseconds away without two context switches; a
    #: process stops spinning for a while when its yields lose the CPU to other busy
    #: processes (see ``Spinner``). Figures: docs/benchmarks.md.
    spin_s: float = option(50e-6, number(at_least=0.0, at_most=0.01))
    #: Seconds a worker keeps looking for its next call (spinning as ``spin_s`` does, yielding
    #: the CPU and backing off when the cores are contested) after it answered one, before it
    #: sleeps. A call that follows within a model step's gap then finds the worker awake,
    #: instead of paying for waking it; an idle worker sleeps after this and uses no CPU.
    #: 0 spins only ``spin_s``. Figures: docs/benchmarks.md.
    idle_spin_s: float = option(0.005, number(at_least=0.0, at_most=0.1))
    #: Seconds without a heartbeat after which a member on another node (seen from the
    #: driver), or the driver (seen from a member), counts as lost. Heartbeats go every
    #: quarter of it; start-up gets longer (``hub.STARTUP_SILENCE_S``).
    node_timeout_s: float = option(1.0, number(at_least=0.2, at_most=600.0))

    @classmethod
    def from_backend_options(cls, options: Mapping[str, Any], backend: str | None = None) -> Self:
        """``options`` (``ExecutorConfig.backend_options``) parsed into this class. The
        executor has refused bad ones already (this is its ``options_cls``); called on its
        own, a bad key or value raises :class:`~executor_core.ConfigError` naming ``backend``
        (default: this class)."""
        return parse_backend_options(cls, options, backend or cls.__qualname__)

    @property
    def ring_sizes(self) -> RingSizes:
        """The sizes of a node's rings."""
        return RingSizes(
            slots=self.slots,
            slot_bytes=self.slot_bytes,
            reply_slots=self.reply_slots,
            reply_slot_bytes=self.reply_slot_bytes or self.slot_bytes,
            spin_s=self.spin_s,
        )
