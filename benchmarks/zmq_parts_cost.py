"""What a zmq message's parts cost on a round trip: the same 129 bytes as four parts (a small
link frame: header, two payload parts, tag) or as one.

    .venv/bin/python benchmarks/zmq_parts_cost.py [--calls 3000] [--runs 3]

Issue 30 (item 2) asks for calls across nodes near a raw pyzmq round trip. A link frame
travels as one zmq part per payload part, between a header part and a tag part, so a small
call or reply is four or five zmq parts where the raw wire sends one; every part is a message
through zmq's pipes and a frame object in pyzmq, on both ends. A ROUTER in this process makes
round trips with a DEALER in a spawned process on 127.0.0.2 that echoes each message, with a
poll before each receive as the link does. Figures: docs/benchmarks.md, "The caller reads its
own replies across nodes".
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import zmq

HOST = "127.0.0.2"
#: A small frame's parts: the header (72 bytes with two lengths), an op, a 40-byte payload,
#: the tag.
FOUR = [b"h" * 72, b"\x01", b"x" * 40, b"m" * 16]


def dealer_peer(port: int, ready: Connection) -> tuple[zmq.Context[Any], zmq.Socket[Any]]:
    """A DEALER connected to the ROUTER on ``port`` of :data:`HOST`, announced to it (a first
    message) and to the parent (``ready``)."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://{HOST}:{port}")
    sock.send(b"hello")
    ready.send(True)
    return ctx, sock


def _echo(port: int, ready: Connection) -> None:
    ctx, sock = dealer_peer(port, ready)
    while True:
        parts = sock.recv_multipart(copy=False)
        if parts[0].bytes == b"stop":
            break
        sock.send_multipart(parts, copy=False)
    sock.close(linger=0)
    ctx.term()


def round_trips(parts: list[bytes], calls: int) -> float:
    """The median round trip, in microseconds, of ``calls`` messages made of ``parts``."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port(f"tcp://{HOST}")
    ours, theirs = multiprocessing.Pipe()
    proc = multiprocessing.get_context("spawn").Process(target=_echo, args=(port, theirs))
    proc.start()
    try:
        ours.recv()
        ident, _ = router.recv_multipart()
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        times = []
        for _ in range(calls + calls // 10):
            began = time.perf_counter()
            router.send_multipart([ident, *parts], copy=False)
            poller.poll(5000)
            router.recv_multipart(copy=False)
            times.append(time.perf_counter() - began)
        router.send_multipart([ident, b"stop"])
        return statistics.median(times[calls // 10 :]) * 1e6
    finally:
        proc.join(10)
        router.close(linger=0)
        ctx.term()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    for _ in range(args.runs):
        four = round_trips(FOUR, args.calls)
        one = round_trips([b"".join(FOUR)], args.calls)
        print(f"4 parts {four:6.1f} us, 1 part {one:6.1f} us ({four / one:.2f}x)")


if __name__ == "__main__":
    main()
