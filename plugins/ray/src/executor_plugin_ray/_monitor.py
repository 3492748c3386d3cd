"""The death monitor: one long-pending "watch" call per actor, resolved when the actor dies.

Its thread also gives back the driver's idle receive memory (nothing else in the driver would
trim the memory of a large reply dropped once its caller stopped waiting).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import ray
from ray import ObjectRef

from executor_channel import IdleTrim

from ._placement import WorkerPlacement

__all__ = ["DeathMonitor", "death_detail"]

logger = logging.getLogger("executor_plugin_ray")

#: Seconds between checks of the stop flag while no actor dies (an idle wait, not a spin).
_POLL_S = 1.0


class DeathMonitor:
    """Calls ``on_death(rank, error)`` when an actor's watch call fails: it returns only at
    shutdown, so it fails as soon as Ray knows the actor or its node is gone, typically well
    under a second after a node is removed or a process killed. Holds no reference to the
    executor."""

    def __init__(
        self, watches: Sequence[ObjectRef[None]], on_death: Callable[[int, BaseException], None]
    ) -> None:
        self._pending: dict[ObjectRef[None], int] = {ref: rank for rank, ref in enumerate(watches)}
        self._on_death = on_death
        #: Held while a death is reported and while a rank's watch is swapped (:meth:`watch`):
        #: a replaced actor's watch, once swapped out, never reports.
        self._lock = threading.Lock()
        self._stop = threading.Event()
        #: Set when a watch is added, so that a monitor with nothing pending looks again.
        self._added = threading.Event()
        self._thread = threading.Thread(target=self._run, name="executor-ray-monitor", daemon=True)
        self._thread.start()

    def watch(self, rank: int, ref: ObjectRef[None]) -> None:
        """Watch ``rank``'s new actor (a rank replacement) by its watch call ``ref``, in place
        of its old one: a death of the old actor is not reported from now on."""
        with self._lock:
            for old in [old for old, owner in self._pending.items() if owner == rank]:
                del self._pending[old]
            self._pending[ref] = rank
        self._added.set()

    def _run(self) -> None:
        try:
            self._watch()
        finally:
            # The workers are gone or going: what this process kept warm for their messages
            # is of no more use.
            IdleTrim.release()

    def _watch(self) -> None:
        # Runs until stopped, even with nothing pending: a rank replacement adds watches.
        while not self._stop.is_set():
            IdleTrim.trim_if_due()  # nothing unless no large message came for IDLE_S
            with self._lock:
                refs = list(self._pending)
            if not refs:
                self._added.wait(_POLL_S)
                self._added.clear()
                continue
            try:
                ready, _ = ray.wait(refs, num_returns=1, timeout=_POLL_S)
            except Exception:  # Ray disconnected under us: nothing left to watch
                if not self._stop.is_set():
                    logger.debug("Ray monitor stopped: ray.wait failed", exc_info=True)
                return
            for ref in ready:
                self._resolved(ref)

    def _resolved(self, ref: ObjectRef[None]) -> None:
        """``ref``'s watch call returned: report the death of its actor, unless the watch was
        swapped out meanwhile (its rank has a new actor) or the monitor stopped."""
        with self._lock:
            rank = self._pending.pop(ref, None)
            if rank is None:
                return
            try:
                ray.get(ref, timeout=0)
            except Exception as exc:  # noqa: BLE001 - any failure of the watch is a death
                if not self._stop.is_set():
                    self._on_death(rank, exc)

    def stop(self, timeout: float = 2 * _POLL_S) -> None:
        """Stop watching (deaths after this are not reported); wait for the thread."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)


def death_detail(placement: WorkerPlacement | None, error: BaseException) -> str:
    """What ``WorkerDiedError.detail`` says of a dead actor: where it ran, and Ray's reason
    (e.g. "The actor died because its node has died")."""
    where = ""
    if placement is not None:
        where = f"Ray actor pid {placement.pid} on node {placement.node_id} ({placement.node_ip}); "
    reason = " ".join(
        line.strip()
        for line in str(error).splitlines()
        if line.strip().startswith(("The actor", "the actor"))
    )
    first = (str(error).splitlines() or [""])[0]
    return where + (reason or f"{type(error).__name__}: {first}")
