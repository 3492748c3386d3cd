"""What authenticating calls across nodes costs per MiB: zmq's CURVE against plain TCP, the
MACs the standard library offers, and the channel's own frame MAC (GMAC).

    .venv/bin/python benchmarks/wire_auth_cost.py [--calls 60]

Issue 30 (item 2) asks for calls across nodes at most 1.5x a raw pyzmq round trip, with the
authentication on. ``executor_channel``'s link frames were signed with HMAC-SHA256 and now
carry a GMAC tag (AES-GCM, through ``cryptography``); this script measures the ways there
were: zmq's own CURVE security (libzmq encrypts and authenticates in its I/O threads, out of
Python), the standard library's HMACs, and the frames' GMAC (AES-256-GCM with the payload
as associated data, fed to it unjoined, as the channel tags a large frame). A DEALER in this
process makes round trips to a ROUTER in a spawned process on 127.0.0.2 that answers each
message with its length, plain and under CURVE; then one MAC of 1 MiB each. Figures:
docs/benchmarks.md, "Across two nodes in `executor bench`".
"""

from __future__ import annotations

import argparse
import hmac
import multiprocessing
import os
import statistics
import time
from multiprocessing.connection import Connection

import zmq
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

HOST = "127.0.0.2"
MIB = 1 << 20


def _serve(keys: tuple[bytes, bytes] | None, port_out: Connection) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    if keys is not None:
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = keys
    port_out.send(sock.bind_to_random_port(f"tcp://{HOST}"))
    port_out.close()
    try:
        while True:
            if not sock.poll(30_000):  # the parent is gone: do not outlive it
                return
            ident, body = sock.recv_multipart(copy=False)
            if body.bytes == b"quit":
                return
            sock.send_multipart([ident, b"%d" % len(body)])
    finally:
        sock.close(linger=0)
        ctx.term()


def _round_trips(curve: bool, calls: int) -> dict[int, float]:
    server_public, server_secret = zmq.curve_keypair()
    keys = (server_public, server_secret) if curve else None
    spawn = multiprocessing.get_context("spawn")
    port_in, port_out = spawn.Pipe(duplex=False)
    proc = spawn.Process(target=_serve, args=(keys, port_out))
    proc.start()
    port_out.close()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        if not port_in.poll(30):
            raise RuntimeError("the server process did not start within 30 s")
        port = port_in.recv()
        if curve:
            sock.curve_serverkey = server_public
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.connect(f"tcp://{HOST}:{port}")
        medians = {}
        for size in (1, MIB):
            data = os.urandom(size)
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                sock.send(data, copy=False)
                if not sock.poll(10_000):
                    raise RuntimeError("no answer within 10 s")
                sock.recv()
                times.append(time.perf_counter() - start)
            medians[size] = statistics.median(times[2:])  # the first calls connect
        sock.send(b"quit")
        return medians
    finally:
        sock.close(linger=100)
        ctx.term()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--calls", type=int, default=60, help="round trips a size (default 60)")
    args = parser.parse_args()
    print(f"libzmq {zmq.zmq_version()}, pyzmq {zmq.pyzmq_version()}, CURVE: {zmq.has('curve')}")
    for curve in (False, True, False, True):  # alternated: the machine's speed drifts
        medians = _round_trips(curve, args.calls)
        name = "CURVE" if curve else "plain"
        print(
            f"{name:5s} round trip, median: 1 byte {medians[1] * 1e6:.0f} µs, "
            f"1 MiB {medians[MIB] * 1e3:.2f} ms"
        )
    data, key = os.urandom(MIB), os.urandom(32)
    for name in ("sha256", "sha1", "blake2b", "md5"):
        start = time.perf_counter()
        for _ in range(50):
            hmac.digest(key, data, name)
        print(f"HMAC-{name.upper():7s} {(time.perf_counter() - start) / 50 * 1e3:.2f} ms per MiB")
    start = time.perf_counter()
    for sequence in range(1, 51):  # as the channel tags a large frame: fed, not joined
        gcm = Cipher(algorithms.AES(key), modes.GCM(sequence.to_bytes(12, "big"))).encryptor()
        gcm.authenticate_additional_data(data)
        gcm.finalize()
    print(f"GMAC, the frames' {(time.perf_counter() - start) / 50 * 1e3:.2f} ms per MiB")


if __name__ == "__main__":
    main()
