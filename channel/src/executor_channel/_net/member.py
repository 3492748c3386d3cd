"""A member that serves one rank itself: it dials the driver's :class:`~.hub.Hub` and runs
the calls in its own process (a Ray actor on another machine, say), with no workers of its own.

It speaks the hub's protocol (:mod:`.hub_protocol`) as a node agent does: ``JOIN``, the
``SPEC`` (its content ignored), a ready frame for its rank (:mod:`.member_join`), replies.

- The *link thread* reads the link: calls go to the call thread's queue, in order; it keeps
  the heartbeats both ways (a ``PING`` after a quarter of ``node_timeout_s`` unsent; serving
  ends after ``node_timeout_s`` of the hub's silence, :data:`~.hub.STARTUP_SILENCE_S` at
  least until its ``READY``), ``KILL``, and replies that could not go at once.
- The *call thread* runs the calls through the handler, one at a time, in order
  (:func:`~.._shm.node_rings.answer_call`: the only unpickling, of frames the link has
  authenticated), and sends each reply itself when it can go at once.

A zmq socket is not thread-safe: every use of the link holds one lock, and the link thread
sleeps on the link's signal descriptor, not in a zmq poll (as the hub's listener does). The stop
frame (a call frame of kind ``KIND_STOP``) waits behind the calls before it; once they are
answered the link thread sends ``BYE`` and serving ends. ``KILL`` ends it at once (queued
calls are dropped). A call crosses one thread hop here (the link thread hands it on): no
bench row at default options runs a member (``ray``'s ranks on other nodes), and Ray's own
actor call costs several times that hop.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._codec import KIND_STOP
from .._shm.doorbell import Doorbell
from .._shm.node_rings import Handler, answer_call
from .connection import Connection
from .hub import STARTUP_SILENCE_S
from .hub_protocol import Op
from .link import ChannelError, Message
from .member_join import join_hub
from .secret import Secret

__all__ = ["Handler", "MemberServer"]

logger = logging.getLogger("executor_channel")

#: What the call thread gets once serving ends: stop taking calls.
_QUIT = None


class MemberServer:
    """Serves one rank's calls from a driver's :class:`~executor_channel.Hub`.

    The constructor dials ``address`` (authenticated with ``secret``, the handshake within
    ``join_timeout`` seconds), joins as node rank ``rank`` saying ``version`` (the hub refuses
    another version), waits up to ``join_timeout`` for the hub's spec, announces ``rank``
    ready, and starts serving in two daemon threads; it returns once they run. It raises
    :class:`~executor_channel.ChannelError` if the hub cannot be reached, refuses this
    member, or gives up (``KILL``) before sending the spec.

    ``prepare``, if given, runs once the hub has admitted this member and before it announces
    the rank ready (the place for a worker's ``init_device`` and ``load_model``): if it
    raises, the hub's start fails with that error and its traceback (a
    :class:`~executor_core.backend.RemoteFailure`), and the constructor raises
    :class:`~executor_channel.ChannelError`.

    Each call runs through ``handle(method, args, kwargs, reply_rank)``, exactly as
    :meth:`WorkerWrapper.handle <executor_core.backend.WorkerWrapper.handle>`: None (this
    rank does not answer) or ``(ok, value)``, sent back as this rank's reply. A handler that
    raises answers its call with the failure; a call whose body cannot be unpickled is
    answered with a :class:`~executor_core.backend.RemoteFailure`, as a ring worker does.

    :attr:`done` is set when serving ends: the hub's stop frame (after every call before it
    was answered, then ``BYE``), ``KILL``, a silent hub (logged as an error on the
    ``executor_channel`` logger), a link failure, or :meth:`stop`. :attr:`reason` says
    which. Call :meth:`stop` in any case (it is idempotent) to join the threads; the handler
    never sees the stop frame, so its owner shuts its worker down once :attr:`done` is set.
    """

    def __init__(
        self,
        address: str,
        secret: Secret,
        rank: int,
        handle: Handler,
        *,
        version: str,
        node_timeout_s: float,
        join_timeout: float,
        prepare: Callable[[], None] | None = None,
    ) -> None:
        if not node_timeout_s > 0:
            raise ValueError(f"node_timeout_s must be > 0, got {node_timeout_s!r}")
        self._rank = rank
        self._handle = handle
        self._timeout = node_timeout_s
        self._interval = node_timeout_s / 4
        self._done = threading.Event()
        self._reason = ""
        #: Serving ends other than by the stop frame: the calls still queued are dropped.
        self._abandoned = False
        #: Why the owner (or a failed call thread) ends serving; empty if no one does.
        self._stop_requested = ""
        #: A reader saw the stop frame: no call after it is taken.
        self._stop_frame_seen = False
        #: Calls for the call thread, in order: ``(kind, frame)``.
        self._calls: collections.deque[tuple[int, memoryview]] = collections.deque()
        #: Replies for the link thread to send; None: the stop frame's turn came, say BYE.
        self._outbox: collections.deque[list[bytes] | None] = collections.deque()
        self._link_lock = threading.Lock()  # held by every use of the link
        self._bell = Doorbell()  # wakes the link thread
        self._call_bell = Doorbell()  # wakes the call thread
        # The bells are rung by either thread and closed by whichever ends last: a ring after
        # the close would write to a closed (or reused) descriptor.
        self._bell_lock = threading.Lock()
        self._bell_closed = False
        self._threads_left = 2
        self._hub_ready = False
        self._last_seen = self._last_sent = 0.0
        self._stop_lock = threading.Lock()
        self._stopped = False
        link: Connection | None = None
        try:
            self._link = link = Connection(address, secret, timeout=join_timeout)
            join_hub(link, rank, version, join_timeout, prepare)
        except BaseException:
            if link is not None:
                link.close()
            self._close_bells()
            raise
        self._last_seen = self._last_sent = time.monotonic()
        self._link_thread = threading.Thread(
            target=self._run_link, name=f"executor-member-link-{rank}", daemon=True
        )
        self._call_thread = threading.Thread(
            target=self._run_calls, name=f"executor-member-calls-{rank}", daemon=True
        )
        self._link_thread.start()
        self._call_thread.start()

    # --- public -----------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """The rank this member serves."""
        return self._rank

    @property
    def done(self) -> threading.Event:
        """Set when serving has ended (see the class docstring); a call that was running
        then may still be finishing until :meth:`stop` joined it."""
        return self._done

    @property
    def reason(self) -> str:
        """Why serving ended (empty while it goes on)."""
        return self._reason if self._done.is_set() else ""

    def stop(self, timeout: float = 5.0) -> None:
        """End serving if it goes on (the hub is told this member failed, so that it does
        not wait for its silence), then wait up to ``timeout`` seconds for both threads (a
        handler still running a long call is left to finish in its daemon thread).
        Idempotent; the link is closed once the link thread ends."""
        with self._stop_lock:
            if not self._stopped:
                self._stopped = True
                self._end_soon("stopped by its owner")
        deadline = time.monotonic() + timeout
        current = threading.current_thread()
        for thread in (self._link_thread, self._call_thread):
            if thread is not current:
                thread.join(max(0.0, deadline - time.monotonic()))

    # --- the link thread --------------------------------------------------------------------

    def _run_link(self) -> None:
        reason = "the link thread failed"
        try:
            reason = self._serve_link()
        except ChannelError as exc:
            reason = f"the link to the driver failed: {exc}"
            logger.error("rank %d: %s; serving ended", self._rank, reason)
        except Exception as exc:
            reason = f"the link thread failed: {type(exc).__name__}: {exc}"
            logger.exception("rank %d: the link thread failed; serving ended", self._rank)
        finally:
            self._reason = reason
            self._abandoned = True
            self._ring(self._call_bell)
            with self._link_lock:
                self._link.close()
            self._done.set()
            self._thread_ended()

    def _serve_link(self) -> str:
        link = self._link
        fds = [self._bell.fd]
        looked = time.monotonic()
        pending = False
        while True:
            now = time.monotonic()
            if now - looked > 2 * self._interval:
                # This thread was not scheduled (or was busy) for a while: what the hub sent
                # meanwhile is read below, so its silence only counts from here.
                self._last_seen = max(self._last_seen, now - self._interval)
            wait = max(0.0, min(self._interval, self._last_sent + self._interval - now))
            if link.wait_shared(0.0 if pending else wait, fds):
                self._bell.clear()
            looked = time.monotonic()
            why = self._stop_requested
            if why:
                self._tell_stopped(why)
                return why
            with self._link_lock:
                if self._flush():
                    logger.info("rank %d: the driver stopped this rank", self._rank)
                    return "the driver's stop frame"
                reason = self._receive(self._read_locked())
                if reason:
                    return reason
                now = time.monotonic()
                if now >= self._last_sent + self._interval:
                    self._send([Op.PING])
                # A send may take the signal of frames that wait: read them without sleeping.
                pending = link.has_input()
            # As the hub does: until every rank is ready, silence is waited out longer.
            limit = self._timeout if self._hub_ready else max(self._timeout, STARTUP_SILENCE_S)
            silent = now - self._last_seen
            if silent > limit:
                logger.error(
                    "rank %d: the driver sent nothing for %.1f s; serving ended",
                    self._rank,
                    silent,
                )
                return f"the driver sent nothing for {silent:.1f} s"

    def _flush(self) -> bool:
        """Send the queued replies in order; True once the stop frame's turn came (BYE sent)."""
        outbox = self._outbox
        while outbox:
            message = outbox.popleft()
            if message is None:
                self._send([Op.BYE])
                return True
            self._send(message)
        return False

    def _receive(self, messages: list[Message]) -> str:
        """Handle what the hub sent, other than calls; why serving ends, if it does."""
        for message in messages:
            op = b"".join(message.chunks[0]) if message.chunks else b""
            if op == Op.READY:
                self._hub_ready = True
            elif op == Op.KILL:
                logger.info("rank %d: the driver killed this rank", self._rank)
                return "killed by the driver"
            # PING: its arrival was the point.
        return ""

    def _tell_stopped(self, why: str) -> None:
        """Best effort: the hub need not wait for this member's silence."""
        reason = f"its member stopped serving ({why})"
        with self._link_lock, contextlib.suppress(ChannelError):
            self._link.send(
                Op.frame(Op.FAILED, {"reason": reason, "started": True}),
                timeout=min(self._timeout, 1.0),
            )

    def _send(self, parts: Sequence[Any]) -> None:
        self._link.send(parts, timeout=self._timeout)
        self._last_sent = time.monotonic()

    def _read_locked(self) -> list[Message]:
        """Read what waits on the link (under its lock): calls go to the call thread's queue,
        in order, and wake it; the rest is returned."""
        rest: list[Message] = []
        recv_now = self._link.recv_now
        while (message := recv_now()) is not None:
            self._last_seen = time.monotonic()
            chunks = message.chunks
            op = b"".join(chunks[0]) if chunks else b""
            if op != Op.CALL or len(chunks) < 2:
                rest.append(message)
            elif not self._stop_frame_seen:  # after the stop frame nothing more runs
                # A frame sent in several parts (or chunks) is joined here, once.
                pieces = [piece for part in chunks[1:] for piece in part]
                frame = pieces[0] if len(pieces) == 1 else memoryview(b"".join(pieces))
                kind = KIND_STOP if frame.nbytes and frame[0] == KIND_STOP else 0
                self._stop_frame_seen = kind == KIND_STOP
                self._calls.append((kind, frame))  # decoded by the call thread
                self._ring(self._call_bell)
        return rest

    # --- the call thread --------------------------------------------------------------------

    def _run_calls(self) -> None:
        try:
            self._serve_calls()
        except Exception as exc:
            logger.exception("rank %d: the call thread failed; serving ends", self._rank)
            self._end_soon(f"its call thread failed: {type(exc).__name__}: {exc}")
        finally:
            self._thread_ended()

    def _serve_calls(self) -> None:
        rank = self._rank
        while True:
            item = self._next_call()
            if item is _QUIT:
                return
            kind, frame = item
            if kind == KIND_STOP:  # every call before it is answered
                self._queue(None)
                return
            reply = answer_call(self._handle, rank, frame)
            if reply is not None:
                self._reply([Op.FRAME, b"".join(reply[0])])

    def _next_call(self) -> tuple[int, memoryview] | None:
        """The next call, waiting for it; :data:`_QUIT` once serving was abandoned (killed,
        silent or stopped: the calls still queued are dropped)."""
        while True:
            if self._abandoned:
                return _QUIT
            if self._calls:
                return self._calls.popleft()
            self._call_bell.wait(self._interval)

    def _reply(self, message: list[bytes]) -> None:
        """Send a reply now if it can go at once and nothing is queued before it, else queue
        it for the link thread (which waits for room, or finds the link failed)."""
        with self._link_lock:
            if not self._outbox and not self._link.closed:
                try:
                    self._link.send(message, timeout=0)
                except ChannelError:  # its queue is full, or the link failed
                    pass
                else:
                    self._last_sent = time.monotonic()
                    if self._link.has_input():  # the send may have taken their signal
                        self._ring(self._bell)
                    return
        self._queue(message)

    def _queue(self, message: list[bytes] | None) -> None:
        self._outbox.append(message)
        self._ring(self._bell)

    # --- any thread ---------------------------------------------------------------------

    def _end_soon(self, why: str) -> None:
        """Make the link thread end serving (telling the hub this member failed)."""
        self._abandoned = True
        self._stop_requested = why
        self._ring(self._bell)
        self._ring(self._call_bell)

    def _ring(self, bell: Doorbell) -> None:
        with self._bell_lock:
            if not self._bell_closed:
                bell.ring()

    def _thread_ended(self) -> None:
        with self._bell_lock:
            self._threads_left -= 1
            if self._threads_left == 0 and not self._bell_closed:
                self._bell_closed = True
                self._close_bells()

    def _close_bells(self) -> None:
        self._bell.close()
        self._call_bell.close()
