"""A member that serves one rank itself: it dials the driver's :class:`~._hub.Hub` and runs
the calls in its own process (a Ray actor on another machine, say), with no workers of its own.

It speaks the hub's protocol (:mod:`._hub_protocol`) as a node agent does: ``JOIN``, then
the ``SPEC`` (whose content it ignores), then a ready frame for its rank (its start-up,
:mod:`._member_join`), then replies. Two daemon threads serve:

- the *link thread* owns the :class:`~._link.Connection` (not thread-safe). It sleeps in one
  poll on the link and the outbox doorbell, sends the reply frames the call thread queued,
  hands each ``CALL`` frame on (undecoded) and keeps the heartbeats both ways: a ``PING``
  when it sent nothing for a quarter of ``node_timeout_s``, and the end of serving when the
  hub sent nothing for ``node_timeout_s`` (:data:`~._hub.STARTUP_SILENCE_S` at least until
  the hub's ``READY``);
- the *call thread* decodes each call (:func:`~._serve.decode_call`: the only unpickling,
  of frames the link has authenticated) and runs it through the handler, one at a time, in
  order. A long call does not hold up the heartbeats.

The stop frame (a call frame of kind ``KIND_STOP``) is queued behind the calls before it:
once they are answered, the link thread sends ``BYE`` and serving ends. ``KILL`` ends it at
once (calls still queued are dropped).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from executor_core.backend import RemoteFailure, method_name

from . import _hub_protocol as wire
from ._codec import KIND_STOP
from ._doorbell import Doorbell
from ._hub import STARTUP_SILENCE_S
from ._link import ChannelError, Connection
from ._member_join import join_hub
from ._secret import Secret
from ._serve import Handler, decode_call, reply_frame

__all__ = ["Handler", "MemberServer"]

logger = logging.getLogger("executor_channel")

#: In the call queue: stop taking calls.
_QUIT = None


class MemberServer:
    """Serves one rank's calls from a driver's :class:`~executor_channel.hub.Hub`.

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
        #: The link thread saw the stop frame: it forwards no more calls.
        self._stop_frame_seen = False
        #: Calls for the call thread: ``(kind, frame)``.
        self._calls: queue.SimpleQueue[tuple[int, memoryview] | None] = queue.SimpleQueue()
        #: Reply messages for the link thread; None: the stop frame's turn came, say BYE.
        self._outbox: collections.deque[list[bytes] | None] = collections.deque()
        self._bell = Doorbell()
        # The bell is rung by the call thread and closed by whichever thread ends last: a
        # ring after the close would write to a closed (or reused) descriptor.
        self._bell_lock = threading.Lock()
        self._bell_closed = False
        self._threads_left = 2
        self._hub_ready = False
        self._last_seen = self._last_sent = 0.0
        self._stop_lock = threading.Lock()
        self._stopped = False
        try:
            self._link = Connection(address, secret, timeout=join_timeout)
        except BaseException:
            self._bell.close()
            raise
        try:
            join_hub(self._link, rank, version, join_timeout, prepare)
        except BaseException:
            self._link.close()
            self._bell.close()
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
            self._calls.put(_QUIT)
            self._link.close()
            self._done.set()
            self._thread_ended()

    def _serve_link(self) -> str:
        link = self._link
        fds = [self._bell.fd]
        looked = time.monotonic()
        while True:
            now = time.monotonic()
            if now - looked > 2 * self._interval:
                # This thread was not scheduled (or was busy) for a while: what the hub sent
                # meanwhile is read below, so its silence only counts from here.
                self._last_seen = max(self._last_seen, now - self._interval)
            next_ping = self._last_sent + self._interval
            frames_waiting, woken = link.wait(max(0.0, min(self._interval, next_ping - now)), fds)
            looked = time.monotonic()
            if woken:
                self._bell.clear()
            why = self._stop_requested
            if why:
                self._tell_stopped(why)
                return why
            if self._flush():
                logger.info("rank %d: the driver stopped this rank", self._rank)
                return "the driver's stop frame"
            if frames_waiting:
                reason = self._receive()
                if reason:
                    return reason
            now = time.monotonic()
            if now >= self._last_sent + self._interval:
                self._send([wire.PING])
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
                self._send([wire.BYE])
                return True
            self._send(message)
        return False

    def _receive(self) -> str:
        """Handle what the hub sent; why serving ends, if it does."""
        recv_now = self._link.recv_now
        while (message := recv_now()) is not None:
            self._last_seen = time.monotonic()
            chunks = message.chunks
            op = b"".join(chunks[0]) if chunks else b""
            if op == wire.CALL and len(chunks) >= 2:
                # A frame sent in several parts (or chunks) is joined here, once.
                pieces = [piece for part in chunks[1:] for piece in part]
                frame = pieces[0] if len(pieces) == 1 else memoryview(b"".join(pieces))
                if self._stop_frame_seen:
                    continue  # after the stop frame: nothing more runs
                if frame.nbytes and frame[0] == KIND_STOP:
                    self._stop_frame_seen = True
                    self._calls.put((KIND_STOP, frame))
                else:
                    self._calls.put((0, frame))  # decoded by the call thread
            elif op == wire.READY:
                self._hub_ready = True
            elif op == wire.KILL:
                logger.info("rank %d: the driver killed this rank", self._rank)
                return "killed by the driver"
            # PING: its arrival was the point.
        return ""

    def _tell_stopped(self, why: str) -> None:
        """Best effort: the hub need not wait for this member's silence."""
        reason = f"its member stopped serving ({why})"
        with contextlib.suppress(ChannelError):
            self._link.send(
                wire.control(wire.FAILED, {"reason": reason, "started": True}),
                timeout=min(self._timeout, 1.0),
            )

    def _send(self, parts: Sequence[Any]) -> None:
        self._link.send(parts, timeout=self._timeout)
        self._last_sent = time.monotonic()

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
        get = self._calls.get
        while True:
            item = get()
            if item is _QUIT:
                return
            kind, frame = item
            if kind == KIND_STOP:  # every call before it is answered
                self._queue(None)
                return
            if self._abandoned:
                return  # killed, silent or stopped: the calls still queued are dropped
            reply = self._answer(rank, frame)
            if reply is not None:
                self._queue(reply)

    def _answer(self, rank: int, frame: memoryview) -> list[bytes] | None:
        """The reply message to a call frame (None if this rank does not answer)."""
        _kind, seq, reply_rank, body = decode_call(frame)
        if isinstance(body, RemoteFailure):  # the call could not be unpickled here
            failure = attrs.evolve(body, rank=rank)
            reply = reply_frame(rank, seq, "<decode>", False, failure)
            return [wire.FRAME, b"".join(reply[0])]
        method: Any = "<call>"
        try:
            method, args, kwargs = body
            answer = self._handle(method, args, kwargs, reply_rank)
        except Exception as exc:  # noqa: BLE001 - the call's failure, shipped to the driver
            answer = False, RemoteFailure.capture(rank, method_name(method), exc)
        if answer is None:
            return None
        ok, value = answer
        reply = reply_frame(rank, seq, method, ok, value)
        return [wire.FRAME, b"".join(reply[0])]

    def _queue(self, message: list[bytes] | None) -> None:
        self._outbox.append(message)
        self._ring()

    # --- any thread ---------------------------------------------------------------------

    def _end_soon(self, why: str) -> None:
        """Make the link thread end serving (telling the hub this member failed)."""
        self._abandoned = True
        self._stop_requested = why
        self._ring()
        self._calls.put(_QUIT)

    def _ring(self) -> None:
        with self._bell_lock:
            if not self._bell_closed:
                self._bell.ring()

    def _thread_ended(self) -> None:
        with self._bell_lock:
            self._threads_left -= 1
            if self._threads_left == 0 and not self._bell_closed:
                self._bell_closed = True
                self._bell.close()
