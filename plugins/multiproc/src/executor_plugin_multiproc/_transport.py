"""MultiprocTransport: the ``mp`` backend's side of the core's Transport contract.

It starts one worker process per rank, writes each call once into the broadcast ring and
reads the replies from the reply rings in :meth:`MultiprocTransport.poll`, which the core
calls from the thread that waits (``polls = True``: no thread hop per call). Everything else
about a call (ordering, reply gathering, timeouts, failure) is the core's.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from typing import ClassVar

from executor_channel.codec import KIND_READY, KIND_STOP, encode, encode_call
from executor_channel.shm import RingAbortedError
from executor_core import ConfigError, ExecutorError, ExecutorFailedError, WorkerDiedError
from executor_core.backend import Call, RemoteFailure, Transport, TransportHost

from ._channel import DriverChannel, decode_reply
from ._group import WorkerGroup
from ._options import MultiprocOptions
from ._process import PARENT_DIED_EXIT, InheritedFd, WorkerSpec, worker_main

__all__ = ["MultiprocTransport"]

_BROKEN = (
    "a call was interrupted half-way through a transfer that spans several ring slots, so "
    "the rings are out of step; shut this executor down and create a new one"
)


class MultiprocTransport(Transport):
    """One worker process per rank on this machine, fed through shared-memory rings.

    A call is written once into a broadcast ring that every worker reads; each worker answers
    through its own reply ring. Waits spin briefly (``spin_s``), then sleep on an eventfd, so
    idle processes use no CPU. A monitor thread (:class:`WorkerGroup`) reports a worker's
    death to the core, which fails every call in flight and every later one.
    """

    polls: ClassVar[bool] = True

    def __init__(self, host: TransportHost) -> None:
        super().__init__(host)
        self._options: MultiprocOptions | None = None
        self._channel: DriverChannel | None = None
        self._group: WorkerGroup | None = None
        #: Set by :meth:`interrupt`: blocked sends and polls return.
        self._aborted = False

    # --- start-up ----------------------------------------------------------------------

    def start(self) -> None:
        host = self.host
        config = host.config
        options = MultiprocOptions.from_backend_options(config.backend_options)
        self._options = options
        workers = config.world_size
        _check_devices(options, config.device, workers, host.worker_env)
        channel = DriverChannel(workers, options, host.add_cleanup)
        self._channel = channel
        self._segment = channel.segment
        self._calls_ring = channel.calls
        self._reply_rings = channel.replies
        self._reply_bell = channel.reply_bell
        self._spinner = channel.spinner

        # Workers read the death pipe; it reaches EOF when this process dies, however it dies.
        death_r, death_w = os.pipe()
        host.add_cleanup(_fd_closer(death_w))
        ctx = multiprocessing.get_context(options.start_method)
        parent_pid = os.getpid() if options.start_method != "forkserver" else None
        processes = []
        try:
            for context in host.contexts():
                rank = context.rank
                spec = WorkerSpec(
                    wrapper=host.wrapper(context).portable(),
                    env=_default_env(config.env, rank, workers),
                    layout=channel.layout,
                    death_pipe=InheritedFd(death_r),
                    parent_pid=parent_pid,
                    spin_s=options.spin_s,
                    close_fds=(death_w,) if options.start_method == "fork" else (),
                    **channel.worker_fds(rank),
                )
                processes.append(
                    ctx.Process(  # type: ignore[attr-defined]  # every context has Process
                        target=worker_main,
                        args=(spec,),
                        name=f"executor-mp-worker-{rank}",
                        daemon=True,
                    )
                )
            # The monitor holds this transport (and so the host), never the executor.
            group = WorkerGroup(processes, self._on_worker_death)
            self._group = group
            group.start()
        finally:
            os.close(death_r)  # the children hold their copies
        self._wait_until_ready(group, options.startup_timeout)
        group.armed = True
        # A worker may have died between its handshake and arming the monitor.
        for rank in range(workers):
            code = group.exit_code(rank)
            if code is not None:
                raise _died(rank, code, "right after start-up")

    def _wait_until_ready(self, group: WorkerGroup, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = set(range(len(self._reply_rings)))
        while True:
            for rank in sorted(pending):
                ring = self._reply_rings[rank]
                while ring.poll():
                    reply = ring.read(decode_reply)
                    if reply is None or reply[0] != KIND_READY:
                        continue
                    _kind, _seq, _rank, ok, value = reply
                    if not ok:
                        raise value.to_error() if isinstance(value, RemoteFailure) else value
                    pending.discard(rank)
            if not pending:
                return
            for rank in sorted(pending):
                code = group.exit_code(rank)
                if code is not None and not self._reply_rings[rank].poll():
                    raise _died(rank, code, "during start-up; its stderr has the details")
            now = time.monotonic()
            if now >= deadline:
                raise ExecutorError(
                    f"worker rank(s) {sorted(pending)} did not finish init_device/load_model "
                    f"within startup_timeout={timeout:g} s (backend_options)"
                )
            # Short naps: a worker that dies before its handshake rings no doorbell.
            self._reply_bell.wait(min(deadline - now, 0.05))

    # --- calls -------------------------------------------------------------------------

    def send(self, call: Call) -> bool:
        method = call.method
        reply_rank = call.reply_rank
        parts, nbytes = encode_call(
            -1 if reply_rank is None else reply_rank,
            call.seq,
            method if type(method) is str else call.wire_method,
            call.args,
            call.kwargs,
        )
        try:
            return self._calls_ring.write(parts, nbytes, call.deadline, self._while_sending)
        except RingAbortedError:
            raise self._closed_error() from None
        except BaseException:
            self._check_rings()
            raise

    def _while_sending(self) -> None:
        """The call ring is full: stop if interrupted, else let replies flow (a worker blocked
        on a full reply ring can then go on and free its call slot)."""
        self._check_abort()
        self.host.while_blocked()

    def poll(self, timeout: float | None) -> None:
        """Hand every reply ready on the rings to the core; if none was, wait for one (spin,
        then the reply doorbell) up to ``timeout``. Often the replies are already there: one
        look at each ring is the whole call."""
        deliver = self.host.deliver
        abort = self._check_abort
        got = False
        try:
            for ring in self._reply_rings:
                reply = ring.try_read(decode_reply, abort)
                if reply is not None:
                    deliver(reply[1], reply[2], reply[3], reply[4])
                    got = True
            if not got and (timeout is None or timeout > 0.0) and not self._aborted:
                self._wait_and_read(timeout)
        except RingAbortedError:
            return
        except BaseException:
            self._check_rings()
            raise

    def _wait_and_read(self, timeout: float | None) -> None:
        """Spin briefly, then sleep on the reply doorbell, until a reply is delivered, the
        timeout passes or :meth:`interrupt` is called."""
        rings = self._reply_rings
        deliver = self.host.deliver
        abort = self._check_abort
        spinner = self._spinner
        bell = self._reply_bell
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        spin_until = spinner.start()
        while True:
            if now < spin_until and spinner.pause():
                pass  # a reply is often only microseconds away
            else:
                spin_until = 0.0
                # Replies and interrupt() ring this doorbell; a stale ring costs one look.
                bell.wait(None if deadline is None else max(0.0, deadline - now))
            got = False
            for ring in rings:
                reply = ring.try_read(decode_reply, abort)
                if reply is not None:
                    deliver(reply[1], reply[2], reply[3], reply[4])
                    got = True
            if got or self._aborted:
                return
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return

    def _check_abort(self) -> None:
        if self._aborted:
            raise RingAbortedError("the executor failed or is closing")

    def _closed_error(self) -> ExecutorError:
        error = self.host.closed_error
        if error is not None:
            return error
        return ExecutorError("the executor failed or is closing")

    def _check_rings(self) -> None:
        """After an interrupted send or read: fail the executor if a ring is mid-message."""
        channel = self._channel
        if channel is not None and channel.broken:
            self.host.worker_died(ExecutorFailedError(_BROKEN))

    # --- failure and stop ------------------------------------------------------------------

    def _on_worker_death(self, rank: int, exitcode: int) -> None:
        """Monitor thread: a worker ended while the executor was running."""
        self.host.worker_died(_died(rank, exitcode, ""))
        group, options = self._group, self._options
        if group is not None and options is not None:
            group.terminate(options.shutdown_grace_s)

    def interrupt(self) -> None:
        self._aborted = True
        channel = self._channel
        if channel is not None:
            channel.wake()

    def close(self, graceful: bool) -> None:
        group, options = self._group, self._options
        if group is None or options is None:
            return  # start-up failed before any process was made
        group.closing = True
        if graceful and group.armed and not self._aborted:
            parts, nbytes = encode(KIND_STOP, True, -1, 0, None)
            deadline = time.monotonic() + options.shutdown_grace_s
            with contextlib.suppress(RingAbortedError):
                self._calls_ring.write(parts, nbytes, deadline, self._while_sending)
            group.stop(options.shutdown_grace_s, options.shutdown_grace_s)
        else:
            group.kill_now()


def _default_env(config_env: dict[str, str], rank: int, workers: int) -> dict[str, str]:
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(workers),
        "LOCAL_WORLD_SIZE": str(workers),
    }
    if "OMP_NUM_THREADS" not in config_env and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        env["OMP_NUM_THREADS"] = str(max(1, (cores or os.cpu_count() or 1) // workers))
    env.update(config_env)
    return env


def _check_devices(
    options: MultiprocOptions, device: str, workers: int, env: dict[str, str]
) -> None:
    """Refuse, before any worker starts, what would fail in the workers: fork once CUDA is
    initialised here (a forked child cannot use CUDA), or fewer GPUs than workers."""
    torch = sys.modules.get("torch")
    if options.start_method == "fork" and torch is not None and torch.cuda.is_initialized():
        raise ConfigError(
            "backend_options",
            {"start_method": "fork"},
            "CUDA is already initialised in this process, and a forked worker cannot use it "
            "('Cannot re-initialize CUDA in forked subprocess'); use start_method='spawn' "
            "(the default) or 'forkserver'",
        )
    if device == "cuda":
        from executor_core.torch import check_gpu_per_local_rank  # imports torch: cuda only

        check_gpu_per_local_rank(workers, env)


def _fd_closer(fd: int) -> Callable[[], None]:
    def close() -> None:
        with contextlib.suppress(OSError):
            os.close(fd)

    return close


def _died(rank: int, exitcode: int, when: str) -> WorkerDiedError:
    detail = when
    if exitcode == PARENT_DIED_EXIT:
        detail = ", ".join(filter(None, [when, "it saw its driver die"]))
    if exitcode < 0:
        return WorkerDiedError(rank, signal=-exitcode, detail=detail)
    return WorkerDiedError(rank, exitcode=exitcode, detail=detail)
