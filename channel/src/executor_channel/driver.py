"""The driver's end of the channel: :class:`ChannelTransport`, the base of a backend whose
workers run out of process; it sends each call to every rank (the rings of this machine, the
hub of the others) and hands their replies to the core."""

from __future__ import annotations

from ._driver import ChannelTransport

__all__ = ["ChannelTransport"]
