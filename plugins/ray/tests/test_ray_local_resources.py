"""What the driver keeps on the shared local Ray instance: no descriptor or thread per executor
past the first (the one socket and thread that stay are Ray's: see
docs/benchmarks.md, "ray"), and no large reply's memory once idle."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from typing import Any

import pytest

from executor_channel._memory import buffers as _buffers
from executor_core import create_executor
from executor_core.testing import conformance_config

pytestmark = pytest.mark.usefixtures("ray_local")

MIB = 1 << 20
#: Executors created and shut down after the warm-up one: descriptors and Python threads may
#: not grow at all, so a leak of one per executor shows at the first; a native thread more
#: per executor passes RAY_LAZY_THREADS by the third.
CYCLES = 5
#: How long a cycle's leftovers may take to go (Ray drops an actor's handles and connections
#: asynchronously); a leak never goes.
SETTLE_S = 5.0
#: Native threads (not Python's) that Ray may start past the warm-up, once: it starts some
#: of its pools lazily (seen: a boost::asio pool thread of its core worker, one thread more in
#: gRPC's EventEngine pool), one or two over the first few executors, then none. Every
#: thread of this SDK is a Python thread, which must not grow at all.
RAY_LAZY_THREADS = 2


def _config(**overrides: Any) -> Any:
    options = {"log_to_driver": False, **overrides.pop("backend_options", {})}
    return conformance_config("ray", world_size=2, backend_options=options, **overrides)


def _cycle() -> None:
    with create_executor(_config()) as executor:
        assert executor.collective_rpc("get_rank") == [0, 1]


def _fds() -> Counter[str]:
    found: Counter[str] = Counter()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # os.listdir's own descriptor
            continue
        found[target.split(":")[0] if ":[" in target else target] += 1
    return found


def _native_threads() -> int:
    """Threads of this process that are not Python threads (Ray's, gRPC's, torch's)."""
    python = {thread.native_id for thread in threading.enumerate()}
    return sum(1 for tid in os.listdir("/proc/self/task") if int(tid) not in python)


def _settled(fds: int, python: int) -> Counter[str]:
    """The descriptors once their count and Python's thread count are back to ``fds`` and
    ``python``, or as they are after :data:`SETTLE_S`."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        now = _fds()
        done = now.total() <= fds and threading.active_count() <= python
        if done or time.monotonic() >= deadline:
            return now
        time.sleep(0.1)


def test_executors_leave_no_descriptors_or_threads_past_the_first() -> None:
    _cycle()  # warm-up: Ray's first actors leave its own connection and thread (see module)
    time.sleep(1.0)
    warm_fds, warm_python, warm_native = _fds(), threading.active_count(), _native_threads()
    for cycle in range(CYCLES):
        _cycle()
        fds = _settled(warm_fds.total(), warm_python)
        assert fds.total() <= warm_fds.total(), (cycle, fds - warm_fds)
        assert threading.active_count() <= warm_python, (cycle, threading.enumerate())
        assert _native_threads() <= warm_native + RAY_LAZY_THREADS, cycle


def test_driver_gives_a_dropped_large_reply_back_once_idle() -> None:
    # The driver reads the reply from its rings; its death monitor, awake every second,
    # trims once no large message came for IDLE_S.
    nbytes = 200_000_000
    page = os.sysconf("SC_PAGE_SIZE")

    def rss_mib() -> float:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * page / MIB

    bound = _buffers.MAX_IDLE_BYTES / MIB
    within = _buffers.IDLE_S + 1.0 + 1.5  # the monitor's period, and a loaded machine's slack
    with create_executor(_config()) as executor:
        assert executor.transport.ranks_on_rings == (0, 1)  # type: ignore[attr-defined]
        executor.collective_rpc("get_rank")
        base = rss_mib()
        reply = executor.collective_rpc(lambda worker: b"x" * nbytes)
        assert [len(part) for part in reply] == [nbytes, nbytes]
        held = rss_mib() - base
        del reply
        start = time.monotonic()
        while rss_mib() - base > bound and time.monotonic() - start < 3 * within:
            time.sleep(0.05)
        took = time.monotonic() - start
        left = rss_mib() - base
    assert held > bound  # resident while referenced: the check below means something
    assert left <= bound, (held, left)
    assert took <= within, (held, left, took)
