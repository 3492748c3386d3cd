"""A member that serves one rank itself over the channel: a worker on another machine than
the driver's (a Ray actor, say) joins the driver's hub and runs its calls (two threads: the
link, with its heartbeats, and the calls)."""

from __future__ import annotations

from ._member import Handler, MemberServer

__all__ = ["Handler", "MemberServer"]
