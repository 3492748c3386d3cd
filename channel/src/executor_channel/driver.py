"""The driver's end of the channel: :class:`ChannelDriver` sends each call to every rank (the
rings of this machine, the hub of the others) and hands their replies to the core. A backend's
``Transport`` delegates ``send``, ``poll`` and ``interrupt`` to it."""

from __future__ import annotations

from ._driver import ChannelDriver

__all__ = ["ChannelDriver"]
