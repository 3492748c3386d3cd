"""The hang bound (``ExecutorConfig.hang_timeout_s``): a rank that stops answering is dead.

One thread per running transport, started only when a bound is set. It looks at the oldest
call in flight every quarter of the bound; once that call has waited the bound, it probes
every rank (:meth:`Transport.probe`) at each look. A rank that has answered none of those
probes for the bound (a process may hold the interpreter for a moment: loading a large
extension, say) is declared dead: the core fails the executor with a
:class:`WorkerDiedError` that says it hung (the recovery policy, if any, takes it from there,
as for any death), then has the transport kill the process. Ranks that answer are left
alone, however long their call takes.

The probe tells a live process from a frozen one, not a useful call from a useless one: a
collective that waits for a frozen peer ends when that peer is killed, and one that waits
with every peer alive is for the call's own timeout (docs/recovery.md, "Hangs").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ._errors import WorkerDiedError

if TYPE_CHECKING:
    from ._host import TransportHost
    from ._transport import Transport

__all__ = ["HangWatch", "has_probe"]

logger = logging.getLogger("executor_core")

#: A probe waits at least this long for an answer: a healthy process answers within a few
#: of the interpreter's switch intervals, a loaded machine may take longer.
_MIN_PROBE_S = 0.5
_MAX_PROBE_S = 5.0


def has_probe(transport: Transport | type[Transport]) -> bool:
    """Whether ``transport`` (or its class) implements :meth:`Transport.probe`."""
    from ._transport import Transport

    cls = transport if isinstance(transport, type) else type(transport)
    return cls.probe is not Transport.probe


class HangWatch:
    """Declares the ranks of one host dead once they stop answering (see the module).

    Holds the host and its transport, never the executor; it ends when the host's calls are
    closed (a failure, a recovery, shutdown), woken by :meth:`stop`.
    """

    def __init__(
        self, host: TransportHost, transport: Transport, ranks: Sequence[int], bound_s: float
    ) -> None:
        self._host = host
        self._transport = transport
        self._ranks = tuple(ranks)
        self.bound_s = bound_s
        #: How often it looks at the oldest call, and how long a probe waits for answers.
        self.tick_s = bound_s / 4
        self.probe_s = min(max(self.tick_s, _MIN_PROBE_S), _MAX_PROBE_S)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="executor-hangs", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the thread (it exits at its next wake-up, which this brings forward)."""
        self._stop.set()

    def _run(self) -> None:
        table = self._host.table
        seen_seq = 0
        seen_at = 0.0
        #: Rank -> when the first of the probes it has not answered since was sent.
        silent_since: dict[int, float] = {}
        while not self._stop.wait(self.tick_s) and table.closed_error is None:
            with table.lock:
                oldest = next(iter(table.calls.values()), None)
            now = time.monotonic()
            if oldest is None or oldest.seq != seen_seq:
                seen_seq, seen_at = (0, now) if oldest is None else (oldest.seq, now)
                silent_since.clear()
                continue
            waited = now - seen_at
            if waited < self.bound_s:
                continue
            try:
                with self._host.probe_lock:
                    silent = self._transport.probe(self._ranks, self.probe_s)
            except Exception:  # a probe that breaks must not end the watch; logged
                logger.exception("the liveness probe failed")
                continue
            for rank in list(silent_since):
                if rank not in silent:
                    del silent_since[rank]  # it answered: alive, however long its call
            for rank in silent:
                if rank in self._ranks:
                    silent_since.setdefault(rank, now)
            done = time.monotonic()
            hung = sorted(r for r, since in silent_since.items() if done - since >= self.bound_s)
            with table.lock:
                # The call may have completed during the probe (its ranks answered it, so
                # they were alive then): the next call in flight starts a watch of its own.
                if table.calls.get(oldest.seq) is not oldest:
                    continue
                hung = [rank for rank in hung if rank in oldest.missing()]
            if hung and table.closed_error is None:
                self._declare(hung, oldest.name, done - seen_at, done - silent_since[hung[0]])
                return

    def _declare(self, ranks: list[int], call: str, waited: float, silent: float) -> None:
        detail = (
            f"hung: no reply to {call} for {waited:.1f} s and no answer to a liveness probe "
            f"for {silent:.1f} s (hang_timeout_s={self.bound_s:g}); killed"
        )
        host = self._host
        node = host.node_named(ranks)
        host.worker_died(WorkerDiedError(ranks[0], detail=detail, ranks=tuple(ranks), node=node))
        try:
            self._transport.kill(ranks)
        except Exception:
            logger.exception("killing hung ranks %s failed", ranks)
