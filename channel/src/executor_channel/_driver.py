"""The driver's end of the channel: :class:`ChannelTransport`, the base of every backend
whose workers run out of process (``mp``, ``ray``).

It carries the calls and replies: each call is encoded once, written into the driver node's
rings (its ranks there read it) and sent through the hub to the members on other machines;
replies come from the reply rings and the hub, read by the thread that waits
(``polls = True``). A subclass starts its workers however it does (processes, Ray actors),
makes the rings and the hub, and hands them to :meth:`ChannelTransport.attach_channel`.
"""

from __future__ import annotations

import contextlib
import select
import time
from collections.abc import Callable, Iterable
from typing import Any

from executor_core import ExecutorClosedError, ExecutorError, ExecutorFailedError
from executor_core.backend import Call, RemoteFailure, Transport, TransportHost

from ._codec import KIND_READY, KIND_STOP, encode, encode_call, plan_assembly
from ._shm.doorbell import Doorbell
from ._shm.node_rings import NodeRings, Reply, decode_reply
from ._shm.ring import Ring, RingAbortedError
from ._shm.spin import Spinner

# Not typing.TYPE_CHECKING's import cost; type checkers treat any constant of this name as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._net.hub import Hub  # zmq: imported by multi-node executors only

__all__ = ["ChannelTransport"]

_BROKEN = (
    "reading a reply was interrupted half-way through a transfer that spans several ring "
    "slots, so the rings are out of step; shut this executor down and create a new one"
)


class ChannelTransport(Transport):
    """Sends calls to every rank and reads their replies: :attr:`rings` for the ranks on this
    machine, :attr:`hub` for the ranks on others (see the module). A subclass implements
    ``start`` and ``close`` (and ``probe``, ``kill``, ``replace`` as it declares), and calls
    :meth:`attach_channel` in ``start`` before it waits for its workers."""

    polls = True

    def __init__(self, host: TransportHost) -> None:
        super().__init__(host)
        #: The rings of the ranks on this machine, and the hub of the ranks on others.
        self.rings: NodeRings | None = None
        self.hub: Hub | None = None
        self._calls_ring: Ring | None = None
        self._reply_rings: list[Ring] = []
        self._reply_bell: Doorbell | None = None
        self._spinner = Spinner(0.0)
        #: Set by :meth:`interrupt`: blocked sends and polls return.
        self.aborted = False
        self._poll_both: select.poll | None = None
        self._ready = False
        #: The first failure reported before every rank was ready: the start raises it.
        self._start_error: ExecutorFailedError | None = None

    @property
    def attached(self) -> bool:
        """Whether :meth:`attach_channel` was called (the start got that far)."""
        return self._reply_bell is not None

    def attach_channel(
        self, rings: NodeRings | None, hub: Hub | None = None, reply_bell: Doorbell | None = None
    ) -> None:
        """Carry calls through ``rings`` (this machine's ranks; None when it runs none: then
        ``reply_bell`` is the doorbell the hub rings) and ``hub`` (set :attr:`hub` later if
        the members join after)."""
        self.rings, self.hub = rings, hub
        if rings is not None:
            self._calls_ring = rings.calls
            self._reply_rings = rings.replies
            self._reply_bell = rings.reply_bell
            self._spinner = rings.spinner
        else:  # no rank on this machine: the hub's doorbell wakes the driver
            if reply_bell is None:
                raise ValueError("without rings, give the reply_bell the hub rings")
            self._reply_bell = reply_bell

    def resume(self) -> None:
        """Rank replacement: :meth:`interrupt` is undone (the core gave this transport its
        new host already)."""
        self.aborted = False

    @property
    def reply_bell(self) -> Doorbell:
        """The doorbell that wakes the driver for replies (the hub rings it too)."""
        assert self._reply_bell is not None, "attach_channel() first"
        return self._reply_bell

    def report_failure(self, error: ExecutorFailedError) -> None:
        """A worker or a machine is gone (the hub's pump calls it): before every rank was
        ready the start raises ``error``; after, the executor fails with it. Any thread."""
        if not self._ready:
            if self._start_error is None:
                self._start_error = error
            return
        self.host.worker_died(error)

    # --- start-up ----------------------------------------------------------------------------

    def wait_until_ready(
        self, ranks: Iterable[int], timeout: float, check: Callable[[set[int]], None]
    ) -> None:
        """Wait until every one of ``ranks`` has sent its ready frame; a failed one raises
        its error. ``check(pending)`` runs between waits and raises if a pending rank can
        no longer answer (its process died, say). Any other reply read meanwhile (from the
        ranks that kept running, when some were replaced) goes to the host."""
        deadline = time.monotonic() + timeout
        pending = set(ranks)
        inbox = self.hub.inbox if self.hub is not None else None
        deliver = self.host.deliver
        while True:
            for ring in self._reply_rings:
                while ring.poll():
                    reply = ring.read(decode_reply, None, None, plan_assembly)
                    if reply is not None:
                        _ready(reply, pending, deliver)
            while inbox:
                _ready(inbox.popleft(), pending, deliver)
            if not pending:
                return
            if self._start_error is not None:
                raise self._start_error
            if self.aborted:  # shut down or failed while starting (during a recovery, say)
                raise self.host.closed_error or ExecutorClosedError(
                    "the executor was shut down while its workers started"
                )
            check(pending)
            now = time.monotonic()
            if now >= deadline:
                raise ExecutorError(
                    f"worker rank(s) {sorted(pending)} did not finish init_device/load_model "
                    f"within startup_timeout={timeout:g} s (backend_options)"
                )
            # Short naps: a worker that dies before its handshake rings no doorbell.
            self.reply_bell.wait(min(deadline - now, 0.05))

    @property
    def is_ready(self) -> bool:
        """Every rank has been ready (:meth:`ready` was called)."""
        return self._ready

    def ready(self) -> None:
        """Every rank is ready: from now on a failure fails the executor, and the hub counts
        silences strictly. Raises a failure reported before this moment."""
        self._ready = True
        if self._start_error is not None:
            raise self._start_error
        hub = self.hub
        if hub is not None:
            hub.ready = True
            hub.wake()

    # --- calls -------------------------------------------------------------------------------

    def send(self, call: Call) -> bool:
        """Encode ``call`` once; write it into the rings (waiting, up to the call's deadline,
        for a free slot), then send it to the other machines.

        False (the core raises :class:`~executor_core.RPCTimeoutError`) if the deadline passed
        first, even part-way through a call that streams through several slots while a rank
        is busy: the call is then withdrawn, on every rank (see :meth:`Ring.write
        <._shm.ring.Ring.write>`), and the next send goes out once the busy rank
        frees slots. An exception part-way through (Ctrl-C) withdraws it the same way."""
        method = call.method
        reply_rank = call.reply_rank
        parts, nbytes = encode_call(
            -1 if reply_rank is None else reply_rank,
            call.seq,
            method if type(method) is str else call.wire_method,
            call.args,
            call.kwargs,
        )
        rings = self.rings
        try:
            sent = True
            if rings is not None:
                deadline = call.deadline
                sent = rings.write_call(
                    parts, nbytes, deadline, self._while_sending, finish_by=deadline
                )
            if sent and self.hub is not None:  # only once every local rank has it
                self.hub.broadcast(parts)
            return sent
        except RingAbortedError:
            raise self._closed_error() from None
        except BaseException:
            self._check_rings()  # _while_sending reads replies
            raise

    def _reply_waiting(self) -> bool:
        """Whether a small reply is waiting on some ring."""
        return any(ring.small_waiting() for ring in self._reply_rings)

    def _while_sending(self) -> None:
        """The call ring is full: stop if interrupted, else let replies flow (a worker blocked
        on a full reply ring can then go on and free its call slot)."""
        self._check_abort()
        self.host.while_blocked()

    def poll(self, timeout: float | None) -> None:
        """Hand every reply ready on the rings to the core; if none was, wait for one up to
        ``timeout`` (spin briefly, then sleep on the reply doorbell) and hand over what
        came, or return at the timeout or :meth:`interrupt`. Often the replies are already
        there: one look at each ring is the whole call."""
        rings = self._reply_rings
        deliver = self.host.deliver
        abort = self._check_abort
        remote = self.hub is not None
        waiting = False
        try:
            while True:
                got = False
                for ring in rings:
                    reply = ring.try_read(decode_reply, abort, plan_assembly)
                    if reply is not None:
                        deliver(reply[1], reply[2], reply[3], reply[4])
                        got = True
                if remote and self._deliver_remote():
                    got = True
                if got or self.aborted:
                    return
                now = time.monotonic()
                if not waiting:  # nothing yet: the wait starts
                    if timeout is not None and timeout <= 0.0:
                        return
                    waiting = True
                    deadline = None if timeout is None else now + timeout
                    spinner = self._spinner
                    spin_until = spinner.start()
                    bell = self.reply_bell
                    sleeper = self._sleeper() if remote else None
                elif deadline is not None and now >= deadline:
                    return
                if now < spin_until:
                    # A reply is often only microseconds away.
                    if not spinner.pause():
                        spin_until = 0.0  # lost the CPU: look once more, then sleep
                        if self._reply_waiting():
                            spinner.contended()  # it came meanwhile: the spin delayed it
                elif sleeper is not None:
                    # Replies from other machines wake this thread itself (it reads them),
                    # the rest ring the doorbell (see _hub).
                    ms = 1000 if deadline is None else max(0, int((deadline - now) * 1000) + 1)
                    if sleeper.poll(ms):
                        bell.clear()
                else:
                    # Replies, the hub and interrupt() ring this doorbell; a stale ring costs
                    # one look.
                    bell.wait(None if deadline is None else max(0.0, deadline - now))
        except RingAbortedError:
            return
        except BaseException:
            self._check_rings()
            raise

    def _sleeper(self) -> select.poll:
        """A poll of the reply doorbell and the hub's link (made once)."""
        if self._poll_both is None:
            assert self.hub is not None
            self._poll_both = select.poll()
            self._poll_both.register(self.reply_bell.fd, select.POLLIN)
            self._poll_both.register(self.hub.reply_fd, select.POLLIN)
        return self._poll_both

    def _deliver_remote(self) -> bool:
        """Hand the replies that came from other machines to the core (reading those that
        wait, see :meth:`Hub.read_replies <._net.hub.Hub.read_replies>`); True if any came."""
        assert self.hub is not None
        self.hub.read_replies()
        inbox = self.hub.inbox
        deliver = self.host.deliver
        got = False
        while inbox:
            _kind, seq, rank, ok, value = inbox.popleft()
            deliver(seq, rank, ok, value)
            got = True
        return got

    def _check_abort(self) -> None:
        if self.aborted:
            raise RingAbortedError("the executor failed or is closing")

    def _closed_error(self) -> ExecutorError:
        error = self.host.closed_error
        if error is not None:
            return error
        return ExecutorError("the executor failed or is closing")

    def _check_rings(self) -> None:
        """After an interrupted send or poll: fail the executor if a reply was left half-read."""
        if self.rings is not None and self.rings.broken:
            self.host.worker_died(ExecutorFailedError(_BROKEN))

    # --- failure and stop --------------------------------------------------------------------

    def interrupt(self) -> None:
        """The executor failed or is closing: wake every blocked send and poll."""
        self.aborted = True
        if self.rings is not None:
            self.rings.wake()
        else:
            with contextlib.suppress(OSError):
                if self._reply_bell is not None:
                    self._reply_bell.ring()

    def send_stop(self, grace_s: float) -> bool:
        """Send every rank the stop message (waiting at most ``grace_s`` for a free slot);
        False if it could not be sent."""
        parts, nbytes = encode(KIND_STOP, True, -1, 0, None)
        deadline = time.monotonic() + grace_s
        sent = self._calls_ring is None
        with contextlib.suppress(RingAbortedError):
            if self._calls_ring is not None:
                sent = self._calls_ring.write(parts, nbytes, deadline, self._while_sending)
        if sent and self.hub is not None:
            self.hub.broadcast(parts)
        return sent

    def stop_hub(self, graceful: bool, grace_s: float, rejoin: bool = False) -> None:
        """Stop the hub: gracefully once every member's workers stopped (at most
        ``grace_s``), else at once (``rejoin``: asking the members to join again)."""
        if self.hub is not None:
            self.hub.stop(graceful, grace_s, rejoin)


def _ready(reply: Reply, pending: set[int], deliver: Callable[[int, int, bool, Any], None]) -> None:
    kind, seq, rank, ok, value = reply
    if kind != KIND_READY:
        deliver(seq, rank, ok, value)
        return
    if not ok:
        raise _error_of(value)
    pending.discard(rank)


def _error_of(value: Any) -> BaseException:
    return value.to_error() if isinstance(value, RemoteFailure) else value
