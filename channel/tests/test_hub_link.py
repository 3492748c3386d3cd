"""SharedListener: the rules of sharing the hub's listener between callers and the pump."""

from __future__ import annotations

import select
import threading
import time

from executor_channel import Listener, Secret
from executor_channel._net.hub import CALLER_HOLD_S, SharedListener
from executor_channel._shm.doorbell import Doorbell


def _rung(bell: Doorbell) -> bool:
    poll = select.poll()
    poll.register(bell.fd, select.POLLIN)
    return bool(poll.poll(0))


def test_before_the_pump_runs_callers_queue_and_read_nothing() -> None:
    wake, replies = Doorbell(), Doorbell()
    with Listener(Secret.generate()) as listener:
        link = SharedListener(listener, 1.0, wake, replies)
        link.send_call([], [b"call"])
        assert _rung(wake)  # queued for the pump, which is told
        assert link.read_for_caller() == []
        # Once the pump runs, a call queued before goes first: the next one is queued too.
        link.started = True
        wake.clear()
        link.send_call([], [b"next"])
        assert _rung(wake)
        assert link.flush(list) == []
        # Nothing queued now: a caller's call goes at once (to no member here), unqueued.
        wake.clear()
        link.send_call([], [b"third"])
        assert not _rung(wake)
    wake.close()
    replies.close()


def test_a_caller_waits_for_the_pump_briefly_never_spins() -> None:
    # While the pump holds the link (a send waiting for room, say), a caller's read waits
    # for it about CALLER_HOLD_S and returns empty-handed: a caller woken by the link's
    # signal then sleeps in that wait instead of polling a signal it cannot clear.
    wake, replies = Doorbell(), Doorbell()
    with Listener(Secret.generate()) as listener:
        link = SharedListener(listener, 1.0, wake, replies)
        link.started = True
        held = threading.Event()
        release = threading.Event()

        def pump() -> None:
            with link._lock:
                held.set()
                release.wait(5)

        thread = threading.Thread(target=pump)
        thread.start()
        try:
            assert held.wait(5)
            began = time.monotonic()
            assert link.read_for_caller() == []
            waited = time.monotonic() - began
            assert CALLER_HOLD_S * 0.9 <= waited < 1.0
        finally:
            release.set()
            thread.join(5)
        assert link.read_for_caller() == []  # free again: read at once, nothing waits
    wake.close()
    replies.close()
