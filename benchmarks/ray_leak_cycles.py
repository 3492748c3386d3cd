"""What a ``ray`` executor leaves in its driver after ``shutdown()``: descriptors and threads.

    .venv/bin/python benchmarks/ray_leak_cycles.py [--cycles 20] [--settle 1.0] [--json FILE]

One local Ray session for the whole run (started once, the way the backend starts one), then
``--cycles`` times: create a ``ray`` executor of 2 workers, make one trivial call, shut it
down. Before the first cycle and after each, once ``--settle`` seconds have passed and the
garbage is collected, it records this process's open descriptors (``/proc/self/fd``, each
named by what it points to: a path, a pipe, an eventfd, or a socket with its addresses) and
its threads (``/proc/self/task``, each by its OS name, and Python's ``threading`` names).

It prints a row per cycle, then what the first cycle left beyond the session alone (whose it
is: Ray's session, or this SDK's), and what any later cycle added beyond the first: a leak
of ours would grow there, cycle after cycle.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import logging
import os
import re
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Any

import psutil  # type: ignore[import-untyped]  # psutil ships no type information

from executor_bench import RaySession
from executor_core import create_executor
from executor_core.testing import conformance_config

#: Only the plugin under test is loaded, as in bench_ray.py: the development install also
#: registers test fixtures, which must not add threads of their own.
PLUGINS_ENV = "EXECUTOR_PLUGINS"


class Snapshot:
    """This process's descriptors and threads at one moment, each by a stable name."""

    def __init__(self) -> None:
        self.fds = _descriptors()
        self.os_threads = _os_threads()
        self.py_threads = Counter(_stable(t.name) for t in threading.enumerate())

    def counts(self) -> dict[str, int]:
        return {
            "fds": sum(self.fds.values()),
            "os_threads": sum(self.os_threads.values()),
            "py_threads": sum(self.py_threads.values()),
        }


def _stable(name: str) -> str:
    """A name with its numbers replaced (thread numbers, ports, inodes, pids), so that the
    same kind of descriptor or thread compares equal from one cycle to the next."""
    return re.sub(r"\d+", "#", name)


def _descriptors() -> Counter[str]:
    sockets: dict[int, str] = {}
    for conn in psutil.Process().net_connections(kind="all"):
        if conn.fd < 0:
            continue
        kind = {1: "unix", 2: "tcp4", 10: "tcp6"}.get(int(conn.family), str(conn.family))
        local = conn.laddr if isinstance(conn.laddr, str) else ":".join(map(str, conn.laddr))
        remote = conn.raddr if isinstance(conn.raddr, str) else ":".join(map(str, conn.raddr))
        sockets[conn.fd] = f"socket {kind} {local or '-'} -> {remote or '-'} {conn.status}"
    found: Counter[str] = Counter()
    listing = "/proc/self/fd"
    for name in os.listdir(listing):
        fd = int(name)
        try:
            target = os.readlink(f"{listing}/{name}")
        except OSError:  # the descriptor os.listdir itself had open, closed by now
            continue
        if target.startswith("socket:"):
            target = sockets.get(fd) or _socket_name(fd)
        elif target.startswith("pipe:"):
            target = "pipe"
        found[_stable(target)] += 1
    return found


def _socket_name(fd: int) -> str:
    """A socket that the kernel's connection tables do not list (a TCP socket whose
    connection is closed, say), named from the descriptor itself."""
    try:
        sock = socket.socket(fileno=os.dup(fd))  # family and type read from the descriptor
    except OSError as exc:
        return f"socket ({exc.strerror})"
    with sock:
        try:
            local = str(sock.getsockname())
        except OSError:
            local = "-"
        try:
            remote = str(sock.getpeername())
        except OSError:
            remote = "not connected"
        return f"socket {sock.family.name} {sock.type.name} {local} -> {remote}"


def _os_threads() -> Counter[str]:
    found: Counter[str] = Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                found[_stable(comm.read().strip())] += 1
        except OSError:  # the thread ended meanwhile
            continue
    return found


def take(settle_s: float) -> Snapshot:
    """A snapshot once ``settle_s`` have passed and the garbage is collected (Ray drops an
    actor's handles and subscriptions asynchronously)."""
    time.sleep(settle_s)
    gc.collect()
    return Snapshot()


def diff(after: Snapshot, before: Snapshot) -> dict[str, dict[str, int]]:
    """What ``after`` has that ``before`` had not (positive) or had more of (negative)."""
    out: dict[str, dict[str, int]] = {}
    for field in ("fds", "os_threads", "py_threads"):
        a: Counter[str] = getattr(after, field)
        b: Counter[str] = getattr(before, field)
        delta = {key: a[key] - b[key] for key in set(a) | set(b) if a[key] != b[key]}
        out[field] = dict(sorted(delta.items()))
    return out


def one_cycle(workers: int) -> None:
    """Create a ``ray`` executor, make one trivial call, shut it down."""
    config = conformance_config("ray", world_size=workers, env={PLUGINS_ENV: "ray"})
    executor = create_executor(config)
    try:
        ranks = executor.collective_rpc("get_rank")
        assert ranks == list(range(workers)), ranks
    finally:
        executor.shutdown()


def raw_cycle(workers: int) -> None:
    """The same with bare Ray actors and no executor: what Ray itself leaves."""
    import ray

    @ray.remote(num_cpus=1)
    class Bare:
        def get_pid(self) -> int:
            return os.getpid()

    actors = [Bare.remote() for _ in range(workers)]  # type: ignore[attr-defined]
    ray.get([actor.get_pid.remote() for actor in actors])
    for actor in actors:
        ray.kill(actor)


def bare_session_cycle(workers: int) -> None:
    """Bare Ray actors in a local session of their own: a plain ``ray.init`` and
    ``ray.shutdown``, none of the backend's code (what Ray itself leaves per session)."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix="ray-cycles-")  # short: Ray's socket paths fit
    # Ray's token authentication, with the token in the environment as the backend passes
    # it: otherwise Ray writes one to ~/.ray/auth_token.
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    try:
        ray.init(
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
            _temp_dir=temp_dir,
        )
        try:
            raw_cycle(workers)
        finally:
            ray.shutdown()
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def run(
    cycles: int, settle_s: float, workers: int = 2, kind: str = "ray", own_session: bool = False
) -> dict[str, Any]:
    """The whole measurement (``kind``: ``ray`` executors, or ``bare`` Ray actors; with
    ``own_session``, the bare actors get a session of their own each time); returns the
    figures."""
    baseline = take(settle_s)
    rows = []
    snapshots = []
    # An executor with no session running starts its own (and stops it at shutdown).
    bare = bare_session_cycle if own_session else raw_cycle
    cycle_fn = one_cycle if kind == "ray" else bare
    for cycle in range(1, cycles + 1):
        cycle_fn(workers)
        snap = take(settle_s)
        snapshots.append(snap)
        counts = snap.counts()
        rows.append(
            {
                "cycle": cycle,
                **counts,
                **{f"{key}_vs_baseline": counts[key] - baseline.counts()[key] for key in counts},
            }
        )
        print(
            f"cycle {cycle:2d}: fds {counts['fds']} ({rows[-1]['fds_vs_baseline']:+d}), "
            f"OS threads {counts['os_threads']} ({rows[-1]['os_threads_vs_baseline']:+d}), "
            f"Python threads {counts['py_threads']} ({rows[-1]['py_threads_vs_baseline']:+d})",
            flush=True,
        )
    first, last = snapshots[0], snapshots[-1]
    # Growth past the first cycle, cycle by cycle: the largest count any kind reached above
    # its count after the first cycle.
    growth: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for snap in snapshots[1:]:
        for field, delta in diff(snap, first).items():
            for key, value in delta.items():
                if value > growth[field].get(key, 0):
                    growth[field][key] = value
    return {
        "kind": kind,
        "own_session": own_session,
        "cycles": cycles,
        "workers": workers,
        "settle_s": settle_s,
        "baseline": baseline.counts(),
        "rows": rows,
        "first_cycle_left": diff(first, baseline),
        "last_vs_first": diff(last, first),
        "max_growth_past_first": {field: dict(sorted(d.items())) for field, d in growth.items()},
    }


def _print_diff(title: str, delta: dict[str, dict[str, int]]) -> None:
    print(f"\n{title}")
    empty = True
    for field, items in delta.items():
        for key, value in items.items():
            print(f"  {field:10s} {value:+d}  {key}")
            empty = False
    if empty:
        print("  nothing")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--settle", type=float, default=1.0, help="seconds before a snapshot")
    parser.add_argument("--json", metavar="FILE", help="also write the figures here")
    parser.add_argument(
        "--bare",
        action="store_true",
        help="cycle bare Ray actors (2, one call, ray.kill) instead of executors: Ray's share",
    )
    parser.add_argument(
        "--session-per-executor",
        action="store_true",
        help="no shared session: each executor (or, with --bare, each set of bare actors) "
        "starts a local Ray and stops it at the end of its cycle",
    )
    args = parser.parse_args()
    os.environ[PLUGINS_ENV] = "ray"
    kind = "bare" if args.bare else "ray"
    if args.session_per_executor:
        figures = run(args.cycles, args.settle, kind=kind, own_session=True)
    else:
        # One local session for the whole run, started the way the backend starts one; each
        # executor takes a lease on it, so none of them starts or stops Ray.
        session = RaySession()
        session.start(2, local_num_cpus=4, log_to_driver=False)
        try:
            figures = run(args.cycles, args.settle, kind=kind)
        finally:
            session.close()
    before = "no Ray" if args.session_per_executor else "the Ray session alone"
    _print_diff(f"left by the first cycle, beyond {before}:", figures["first_cycle_left"])
    _print_diff(
        f"after cycle {args.cycles}, beyond what the first cycle left:", figures["last_vs_first"]
    )
    _print_diff(
        "the most any later snapshot had beyond the first cycle's:",
        figures["max_growth_past_first"],
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=2)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
