"""The account of the frames a link drops: a count per :class:`DropReason`, and a warning on
the ``executor_channel`` logger for the first drop of each peer (debug records after it)."""

from __future__ import annotations

import logging
import threading
from collections import Counter

from ._frames import DropReason

__all__ = ["Drops"]

log = logging.getLogger("executor_channel")

# Peers that get their own warning; beyond this one more warning says the rest are silent, so
# a flood of connections cannot flood the log.
_MAX_WARNED_PEERS = 1024


class Drops:
    """Counts dropped frames per reason; warns once per peer."""

    def __init__(self, side: str, fingerprint: str) -> None:
        #: Peers are routing ids (bytes) at a listener, one name at a connection.
        self._side = side
        self._fingerprint = fingerprint
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._warned: set[bytes | str] = set()
        self._overflowed = False

    def add(self, peer: bytes | str, reason: DropReason) -> None:
        """Count a drop from ``peer`` (a zmq routing id, or a name); warn if it is the first."""
        with self._lock:
            self._counts[reason.value] += 1
            first = peer not in self._warned and len(self._warned) < _MAX_WARNED_PEERS
            if first:
                self._warned.add(peer)
            overflow = not first and peer not in self._warned and not self._overflowed
            if overflow:
                self._overflowed = True
        name = peer.hex() if isinstance(peer, bytes) else peer
        if first and reason in (DropReason.GATE, DropReason.PENDING):
            log.warning(
                "%s refused %s (%s); later refusals are only counted. A connection is served "
                "only if it proves in zmq's handshake that it holds the same secret "
                "(fingerprint %s here).",
                self._side,
                name,
                reason.value,
                self._fingerprint,
            )
        elif first:
            log.warning(
                "%s dropped a frame from peer %s (%s); later drops from this peer are only "
                "counted. A peer is served only if it holds the same secret (fingerprint %s "
                "here) and sends fresh, intact frames.",
                self._side,
                name,
                reason.value,
                self._fingerprint,
            )
        elif overflow:
            log.warning(
                "%s: more than %d peers sent frames that were dropped; further peers are "
                "only counted",
                self._side,
                _MAX_WARNED_PEERS,
            )
        else:
            log.debug("%s dropped a frame from peer %s (%s)", self._side, name, reason.value)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
