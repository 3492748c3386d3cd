"""Bounded spinning that backs off when other processes want the CPU.

The waiting policy of the rings, on one page. A process has one :class:`Spinner`; every
wait of a ring reader or writer, and the driver's wait for replies, goes through these
states (``spin_s`` and ``idle_spin_s`` are ``ChannelOptions``):

=========  =================================  ========================================
state      what the waiter does               leaves it when
=========  =================================  ========================================
LOOK       checks its counter once (no        data or space is there: done; else SPIN
           system call)                       if the budget allows, else SLEEP
SPIN       yields the CPU (``sched_yield``)   data came: done. ``spin_s`` passed (a
           and looks again, for at most       worker after a reply: ``idle_spin_s``):
           ``spin_s``                         SLEEP. A yield lost the CPU for a time
                                              slice (``LOST_CPU_S``): SLEEP, and QUIET
                                              if the data came meanwhile
SLEEP      waits on its eventfd doorbell      woken (the peer rings after publishing),
           (a deadline, or ``MAX_SLEEP_S``    deadline passed, or the re-check time:
           re-checks where an abort check     LOOK
           must run)
QUIET      (per process) no wait may spin     ``QUIET_MIN_S``, doubling up to
           for a while: LOOK goes straight    ``QUIET_MAX_S`` while losses keep coming
           to SLEEP                           soon after the last quiet period
=========  =================================  ========================================

One more rule acts around the waits. **Bulk**: while a message of several slots moves
(:attr:`Spinner.bulk`), a lost yield does not count towards QUIET. Which benchmark row at
default options needs each rule is in docs/benchmarks.md ("The waiting policy"): without
QUIET and the lost-yield stop, a no-op beside two busy processes takes about 40 times as
long (the ``no-op, back to back`` row on a contested machine); without the bulk exemption,
the p99 of ``bytes 1 MiB`` is about 4 times as long.

A waiter that expects an answer within microseconds spins for a moment (calling
``sched_yield`` each round) before it sleeps: that saves two context switches per call
when every process has a core. But ``sched_yield`` hands the CPU to any other runnable
process on the same core, and when that is a busy process (another job on a shared machine)
the yield returns only after its time slice, milliseconds later, so spinning then costs a
no-op call far more than sleeping would (figures: docs/benchmarks.md, mp). A
sleeper on an eventfd, by contrast, is woken at once (the scheduler favours it).

So a yield that took much longer than a peer's short turn ends the wait's spin, and the
wait looks once more: if what it waits for came while this process was off the CPU, the
spin delayed it, and the cores are contested. The process then stops spinning for a while
and only sleeps (:meth:`Spinner.contended`). Only small messages count, between small
messages: while a message of several slots moves, the processes at both ends copy it for
milliseconds and take each other's CPU, which says nothing of other jobs, and quieting every
wait for long after such a transfer would slow the small calls that follow it. A yield lost
while nothing came cost nothing and does not count either.
"""

from __future__ import annotations

import os
import time

__all__ = ["Spinner"]

#: A yield that returns later than this lost the CPU for a time slice, not to a peer's
#: short turn (a no-op call's whole round trip is far shorter).
LOST_CPU_S = 0.0005
#: How long a process that saw contention waits before it spins again: from the shortest
#: (a one-off, such as other processes starting up) doubling to the longest while losses
#: keep coming (busy cores cost one time slice per try, at most once per ``QUIET_MAX_S``).
QUIET_MIN_S = 0.01
QUIET_MAX_S = 1.0


class Spinner:
    """The spin budget of one process (shared by its waits; see module docstring)."""

    def __init__(self, spin_s: float) -> None:
        self.spin_s = spin_s
        self._quiet_until = 0.0
        self._quiet_s = QUIET_MIN_S
        #: True while the last message this process read or wrote spanned several slots
        #: (the rings set it): :meth:`contended` then ignores a loss.
        self.bulk = False

    def start(self, spin_s: float | None = None) -> float:
        """Monotonic time until which a wait that starts now may spin (0.0: do not spin), for
        ``spin_s`` (default: :attr:`spin_s`)."""
        budget = self.spin_s if spin_s is None else spin_s
        if not budget:
            return 0.0
        now = time.monotonic()
        if now < self._quiet_until:
            return 0.0
        return now + budget

    def pause(self) -> bool:
        """Yield the CPU once; False if that lost it for a time slice: the wait stops
        spinning, and calls :meth:`contended` if what it waits for came meanwhile."""
        before = time.monotonic()
        os.sched_yield()
        return time.monotonic() - before < LOST_CPU_S

    def contended(self) -> None:
        """What a wait waited for came while its yield had lost the CPU: stop spinning for
        a while, longer each time this repeats soon after the last quiet time. Callers
        report only small messages; ignored while :attr:`bulk` is set."""
        if self.bulk:
            return
        now = time.monotonic()
        if now - self._quiet_until > self._quiet_s:  # calm since the last quiet time
            self._quiet_s = QUIET_MIN_S
        else:
            self._quiet_s = min(QUIET_MAX_S, 2 * self._quiet_s)
        self._quiet_until = now + self._quiet_s
