"""The cost of the ring's memory fences: raw Ring round trips before and after, interleaved.

    .venv/bin/python benchmarks/bench_ring_fences.py [--rev HEAD] [--rounds 20]
        [--calls 5000] [--big-calls 300] [--mp-calls 0]

A round trip is what a call of the ``mp`` backend does on the channel, without the codec and
the executor: one process writes a message into a ring that 2 reader processes read; each
reader answers with 16 bytes on a ring of its own, and the first process reads both answers.
Cases: a 64-byte message ("no-op") and a 1 MiB one (in one slot; each reader copies it out).
Waits spin for 50 µs, then sleep on the doorbells (``spin_s`` of ``mp``'s default options).

Sides, each in fresh processes, taking turns in ``--rounds`` rounds (the order rotating) so
that the machine's noise hits them alike:

- ``before``: ``executor_channel`` of ``--rev`` (``git archive``; plain loads and stores);
- ``after``: this tree's, its fences as this CPU gets them (on x86-64 only the full fence of
  the sleep/wake-up handshake is issued; acquire and release need no instruction);
- ``after, every fence``: this tree's with ``EXECUTOR_CHANNEL_FENCE=weak``, every acquire and
  release fence issued as on aarch64: what a weakly ordered CPU pays, measured here;
- ``after, lock fence``: ``EXECUTOR_CHANNEL_FENCE=lock``, the fallback without libatomic.

Reported: the median and p90 round trip per side and case (the median over rounds of each
round's median), its difference to ``before``, the median over rounds of the difference to
``before`` in the same round, and (first 3 rounds) the cost of the counter operations of one
message on their own. On a shared 2-core machine a set of processes can land well or badly
on the cores for its whole life, so round trips move by microseconds from one child to the
next: many short rounds, and the per-operation costs, say more than one long one.
``--mp-calls N`` adds the no-op ``collective_rpc`` on an ``mp`` executor with 2 workers (N
calls a round).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
READERS = 2
SIDES: dict[str, dict[str, str]] = {
    "before": {},
    "after": {"EXECUTOR_CHANNEL_FENCE": "auto"},
    "after, every fence": {"EXECUTOR_CHANNEL_FENCE": "weak"},
    "after, lock fence": {"EXECUTOR_CHANNEL_FENCE": "lock"},
}


# --- a child: one side, one round --------------------------------------------------------


def _child(calls: int, big_calls: int, mp_calls: int, micro: bool) -> dict[str, Any]:
    from executor_channel import shm

    slot_bytes = 2 * MIB
    call_layout = shm.RingLayout(0, READERS, 4, slot_bytes)
    reply_layouts = []
    offset = call_layout.nbytes
    for _ in range(READERS):
        reply_layouts.append(shm.RingLayout(offset, 1, 2, 4096))
        offset += reply_layouts[-1].nbytes
    segment = shm.SharedSegment.create(offset)
    call_bells = [shm.Doorbell() for _ in range(READERS)]
    call_space = shm.Doorbell()
    reply_bell = shm.Doorbell()
    reply_spaces = [shm.Doorbell() for _ in range(READERS)]
    pids = []
    for index in range(READERS):
        pid = os.fork()
        if pid == 0:
            try:
                bells = (call_bells[index], call_space, reply_bell, reply_spaces[index])
                _serve(segment, (call_layout, reply_layouts[index]), index, bells)
            finally:
                os._exit(0)
        pids.append(pid)
    spin = shm.Spinner(50e-6)
    calls_ring = shm.Ring(
        segment.buf,
        call_layout,
        reader=None,
        data_bells=call_bells,
        space_bell=call_space,
        spin=spin,
    )
    replies = [
        shm.Ring(
            segment.buf,
            layout,
            reader=0,
            data_bells=[reply_bell],
            space_bell=reply_spaces[i],
            spin=spin,
        )
        for i, layout in enumerate(reply_layouts)
    ]

    def round_trips(payload: bytes, n: int) -> list[float]:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            calls_ring.write([payload], len(payload))
            for ring in replies:
                ring.read(bytes)
            times.append(time.perf_counter() - start)
        return times

    round_trips(b"x" * 64, 200)  # warm up
    result: dict[str, Any] = {
        "noop": round_trips(b"x" * 64, calls),
        "1MiB": round_trips(b"y" * MIB, big_calls),
    }
    calls_ring.write([b""], 0)  # stop
    for pid in pids:
        os.waitpid(pid, 0)
    segment.close()
    if mp_calls:
        result["mp noop"] = _mp_noop(mp_calls)
    if micro:
        result["micro_ns"] = _micro()
    return result


def _serve(segment: Any, layouts: tuple[Any, Any], index: int, bells: tuple[Any, ...]) -> None:
    """A reader (forked: the doorbells are the parent's): answer every call until an empty
    one."""
    from executor_channel import shm

    call_bell, call_space, reply_bell, reply_space = bells
    spin = shm.Spinner(50e-6)
    calls = shm.Ring(
        segment.buf,
        layouts[0],
        reader=index,
        data_bells=[call_bell],
        space_bell=call_space,
        spin=spin,
    )
    replies = shm.Ring(
        segment.buf,
        layouts[1],
        reader=None,
        data_bells=[reply_bell],
        space_bell=reply_space,
        spin=spin,
    )
    answer = b"r" * 16
    while True:
        size = calls.read(lambda view: len(bytes(view)))
        if not size:
            return
        replies.write([answer], len(answer))


def _micro() -> dict[str, float]:
    """ns per counter operation of a message, as the ring makes them now: a reader's
    ``observe`` (the load that finds a message, and its acquire fence), the writer's
    ``publish`` (a store), a reader's ``release`` (its store, then the load of the flag)."""
    import mmap

    mapping = mmap.mmap(-1, 4096)
    buf = memoryview(mapping)
    try:
        from executor_channel.testing import fences as _fence
    except ImportError:  # before: struct's plain loads and stores
        import struct

        plain = struct.Struct("<Q")
        env: dict[str, Any] = {"buf": buf, "load": plain.unpack_from, "store": plain.pack_into}
        stmts = {
            "observe": "load(buf, 0)[0]",
            "publish": "store(buf, 0, 7)",
            "release": "store(buf, 64, 7); load(buf, 8)[0]",
        }
    else:
        env = {"buf": buf, "f": _fence, "weak": _fence.WEAK_ORDER}
        stmts = {
            "observe": "f.load(buf, 0)[0]\nif weak: f.acquire_fence()",
            "publish": "f.store_release(buf, 0, 7)",
            "release": "f.store_fence_load(buf, 64, 7, 8)",
        }
    out = {}
    for name, stmt in stmts.items():
        n = 200_000
        best = min(timeit.repeat(stmt, globals=env, number=n, repeat=5))
        out[name] = round(best / n * 1e9, 1)
    del env
    buf.release()
    mapping.close()
    return out


def _mp_noop(calls: int) -> list[float]:
    os.environ["EXECUTOR_PLUGINS"] = "multiproc"
    from executor_core import ExecutorConfig, WorkerBase, create_executor

    config = ExecutorConfig(backend="mp", worker_cls=WorkerBase, tensor_parallel_size=READERS)
    times = []
    with create_executor(config) as executor:
        for _ in range(200):
            executor.collective_rpc("check_health")
        for _ in range(calls):
            start = time.perf_counter()
            executor.collective_rpc("check_health")
            times.append(time.perf_counter() - start)
    return times


# --- the driver: sides in turn --------------------------------------------------------------


def _before_tree(rev: str, into: str) -> str:
    """``channel/src`` of ``rev`` under ``into``; returns the directory to put on the path."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "channel/src/executor_channel"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return os.path.join(into, "channel", "src")


def _run_side(side: str, before_path: str, args: argparse.Namespace, micro: bool) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "EXECUTOR_CHANNEL_FENCE"}
    env.update(SIDES[side])
    if side == "before":
        env["PYTHONPATH"] = before_path + os.pathsep + env.get("PYTHONPATH", "")
    command = [sys.executable, __file__, "--child", "--calls", str(args.calls)]
    command += ["--big-calls", str(args.big_calls), "--mp-calls", str(args.mp_calls)]
    command += ["--micro"] if micro else []
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{side}: {done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default="HEAD", help="the 'before' revision (default HEAD)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--big-calls", type=int, default=300)
    parser.add_argument("--mp-calls", type=int, default=0)
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--micro", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.calls, args.big_calls, args.mp_calls, args.micro)))
        return
    sides: list[str] = args.sides
    per_round: dict[str, dict[str, list[tuple[float, float]]]] = {s: {} for s in sides}
    micro: dict[str, list[dict[str, float]]] = {s: [] for s in sides}
    with tempfile.TemporaryDirectory() as tmp:
        before_path = _before_tree(args.rev, tmp)
        for r in range(args.rounds):
            order = sides[r % len(sides) :] + sides[: r % len(sides)]
            for side in order:
                result = _run_side(side, before_path, args, micro=r < 3)
                if "micro_ns" in result:
                    micro[side].append(result.pop("micro_ns"))
                for case, times in result.items():
                    stats = (statistics.median(times), _pct(times, 0.9))
                    per_round[side].setdefault(case, []).append(stats)
                print(f"round {r + 1}/{args.rounds}: {side} done", file=sys.stderr)
    load = os.getloadavg()
    print(f"# Ring fences, before ({args.rev}) and after: {args.rounds} rounds, interleaved")
    print()
    print(f"machine {os.uname().machine}, {os.cpu_count()} CPUs, load average {load[0]:.1f}; ")
    print(f"{args.calls} no-op and {args.big_calls} 1 MiB round trips per side and round")
    print()
    print("| case | side | median µs | p90 µs | median vs before | per round, vs before |")
    print("|---|---|---|---|---|---|")
    cases = list(per_round[sides[0]])
    for case in cases:
        base = statistics.median(m for m, _ in per_round[sides[0]][case])
        for side in sides:
            rounds = per_round[side][case]
            median = statistics.median(m for m, _ in rounds)
            p90 = statistics.median(p for _, p in rounds)
            diff = (median - base) * 1e9
            paired = statistics.median(
                (m - b) * 1e9
                for (m, _), (b, _) in zip(rounds, per_round[sides[0]][case], strict=True)
            )
            print(
                f"| {case} | {side} | {median * 1e6:.1f} | {p90 * 1e6:.1f} | "
                f"{diff:+,.0f} ns ({median / base:.3f}x) | {paired:+,.0f} ns |"
            )
    print()
    print(
        "ns per counter operation, best of 5: observe (a reader's load that finds a message,"
        " with its acquire fence), publish (the writer's store), release (a reader's store,"
        " then its load of the writer's flag):"
    )
    print()
    for side in sides:
        names = micro[side][0]
        row = ", ".join(
            f"{name} {statistics.median(m[name] for m in micro[side]):.0f}" for name in names
        )
        print(f"- {side}: {row}")


if __name__ == "__main__":
    main()
