"""The driver gives a large reply's memory back once idle, without another call to prompt it.

A driver reads replies only while a caller waits, so nothing of the channel runs in it once a
large reply has been handed over; its worker monitor wakes for the receive cache's idle trim
(``executor_channel.IdleTrim``). Each check runs in a process of its own: the heap
settings of the warm receive memory are process-wide, and a resident size is only telling in
a process that did nothing else.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from executor_channel._memory import buffers as _buffers

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        sys.platform != "linux" or os.confstr("CS_GNU_LIBC_VERSION") is None,
        reason="the warm heap and /proc/self/statm are glibc's and Linux's",
    ),
]

MIB = 1 << 20
#: The documented bound on what a process keeps of large messages while idle.
BOUND_MIB = _buffers.MAX_IDLE_BYTES / MIB
#: The documented time: memory goes back IDLE_S after the last large message. The slack
#: covers a loaded 2-core machine (the monitor thread has to get the CPU to trim).
WITHIN_S = _buffers.IDLE_S + 1.5

_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, threading, time
    from executor_core import create_executor
    from executor_core.testing import conformance_config

    NBYTES = 200_000_000
    PAGE = os.sysconf("SC_PAGE_SIZE")

    def rss_mib():
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * PAGE / (1 << 20)

    def until_within(base, bound_mib, limit_s):
        # Seconds until the resident size is back within bound_mib of base (None: never).
        start = time.monotonic()
        while time.monotonic() - start < limit_s:
            if rss_mib() - base <= bound_mib:
                return time.monotonic() - start
            time.sleep(0.02)
        return None

    def monitor_switches():
        [monitor] = [t for t in threading.enumerate() if t.name == "executor-mp-monitor"]
        with open(f"/proc/self/task/{monitor.native_id}/status") as status:
            for line in status:
                if line.startswith("voluntary_ctxt_switches"):
                    return int(line.split()[1])
        raise AssertionError("no voluntary_ctxt_switches")

    bound, limit = float(sys.argv[1]), float(sys.argv[2])
    out = {}
    with create_executor(conformance_config("mp", world_size=2)) as ex:
        ex.collective_rpc("get_rank")
        base = rss_mib()
        # Dropped at once: a reply of 2 x 200 MB.
        reply = ex.collective_rpc(lambda worker: b"x" * NBYTES)
        out["held_mib"] = rss_mib() - base
        assert [len(part) for part in reply] == [NBYTES, NBYTES]
        del reply
        out["dropped_within_s"] = until_within(base, bound, 3 * limit)
        out["dropped_end_mib"] = rss_mib() - base
        # Kept past the first idle trim, then dropped.
        reply = ex.collective_rpc(lambda worker: b"y" * NBYTES)
        time.sleep(limit)
        out["kept_mib"] = rss_mib() - base
        del reply
        out["late_within_s"] = until_within(base, bound, 3 * limit)
        out["late_end_mib"] = rss_mib() - base
        # Nothing kept any more: the monitor sleeps without a timeout again.
        time.sleep(limit)
        switches = monitor_switches()
        time.sleep(limit)
        out["idle_wakes"] = monitor_switches() - switches
    print(json.dumps(out))
    """
)


def _run() -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(BOUND_MIB), str(WITHIN_S)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    figures: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return figures


def test_driver_gives_a_dropped_large_reply_back_within_idle_s() -> None:
    figures = _run()
    # While referenced, the reply is resident: above the bound, so the checks below mean
    # something.
    assert figures["held_mib"] > BOUND_MIB, figures
    assert figures["kept_mib"] > BOUND_MIB, figures
    # Dropped at once: back within the bound within IDLE_S of the reply, with no other call.
    assert figures["dropped_within_s"] is not None, figures
    assert figures["dropped_within_s"] <= WITHIN_S, figures
    assert figures["dropped_end_mib"] <= BOUND_MIB, figures
    # Still referenced at the first idle trim and dropped later: within IDLE_S of the drop.
    assert figures["late_within_s"] is not None, figures
    assert figures["late_within_s"] <= WITHIN_S, figures
    assert figures["late_end_mib"] <= BOUND_MIB, figures
    # Once nothing is kept, the monitor no longer wakes for the trim.
    assert figures["idle_wakes"] == 0, figures
