"""A call's round trip to a rank served by a ``MemberServer`` on another "node", beside the raw
pyzmq wire in the same run.

    .venv/bin/python benchmarks/member_round_trip.py [--calls 3000] [--rounds 4]

A member serves one rank in its own process and joins the driver's hub over an authenticated
link (``ray`` runs every worker on another node this way). Here the hub runs in this process
and the member in a spawned process that dials it from 127.0.0.2; each call is a no-op (and
then a 1 MiB ``bytes`` argument), sent and read back as the driver's poll does (the caller
reads its replies itself). The baseline is the wire alone: a ROUTER in this process and a
DEALER in a spawned process on 127.0.0.2 that unpickles each call and sends back a pickled
answer, pickle protocol 5, no authentication. Beside it, the wire with the least a link must
add to be safe to unpickle from: each message carries a sequence number, which must grow, and
a GMAC tag (AES-GCM over an empty plaintext, as the link's frames) under a key of its
direction, checked before the message is unpickled. And below the wire, a plain TCP socket of
the standard library, which the calling thread writes and reads at each end (no zmq I/O
thread), unauthenticated and authenticated as the wire above. The sides take turns in
rounds, so the machine's noise hits them alike. Figures: docs/benchmarks.md, "A member reads
its own calls" and "What a link adds to the wire".
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import hmac
import multiprocessing
import pickle
import secrets
import select
import socket
import statistics
import struct
import time
from collections.abc import Callable
from multiprocessing.connection import Connection as Pipe
from typing import Any

import zmq
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from zmq_parts_cost import HOST, dealer_peer  # this folder: the script's own

from executor_channel import Listener, Secret
from executor_channel.codec import KIND_STOP, encode, encode_call
from executor_channel.hub import Hub
from executor_channel.member import MemberServer
from executor_channel.shm import Doorbell

VERSION = "bench"
RANK = 1
WAIT = 30.0
_SEQUENCE = struct.Struct("!Q")
_NONCE = struct.Struct("!4xQ")  # the sequence in GCM's 12-byte nonce
#: The authenticated sides make no-op calls only: a message is sealed as one buffer, joined
#: and copied, fair for a small one but not for 1 MiB (the link sends a large part as it is,
#: which is what the member's row measures).
AUTHENTICATED = "pyzmq wire, authenticated"
AUTHENTICATED_TCP = "plain TCP socket, authenticated"
_LENGTH = struct.Struct("!I")  # the plain socket's length prefix
_TCP_BUFFER = 2 << 20  # what the plain socket's ends read into: more than a 1 MiB call


def _answer(method: Any, args: Any, kwargs: Any, reply_rank: int | None) -> tuple[bool, Any]:
    return True, len(args[0]) if args else None


def _member(address: str, key: str, rank: int) -> None:
    member = MemberServer(
        address,
        Secret.from_hex(key),
        rank,
        _answer,
        version=VERSION,
        node_timeout_s=WAIT,
        join_timeout=WAIT,
    )
    member.done.wait()
    member.stop()


def _wire(port: int, ready: Pipe, key: bytes | None) -> None:
    context, sock = dealer_peer(port, ready)
    seal = Sealer(key, b"reply") if key else None
    check = Sealer(key, b"call") if key else None
    while True:
        frame = sock.recv(copy=False)
        if frame.bytes == b"stop":
            break
        _method, args = pickle.loads(check.open(frame.buffer) if check else frame.buffer)
        answer = pickle.dumps(len(args[0]) if args else None, protocol=5)
        sock.send(seal.seal(answer) if seal else answer)
    sock.close(linger=0)
    context.term()


class Sealer:
    """One direction of the authenticated wire: ``sequence (8 bytes) || message || tag``."""

    def __init__(self, key: bytes, label: bytes) -> None:
        self._gcm = AESGCM(hashlib.sha256(key + label).digest())
        self._sent = 0
        self._last = 0

    def seal(self, message: bytes) -> bytes:
        self._sent += 1
        signed = _SEQUENCE.pack(self._sent) + message
        return signed + self._gcm.encrypt(_NONCE.pack(self._sent), b"", signed)

    def open(self, data: memoryview) -> memoryview:
        """The message in ``data``, after its sequence and tag are checked (else ValueError)."""
        (sequence,) = _SEQUENCE.unpack_from(data)
        signed = data[: len(data) - 16]
        tag = self._gcm.encrypt(_NONCE.pack(sequence), b"", signed)
        if sequence <= self._last or not hmac.compare_digest(tag, data[len(data) - 16 :]):
            raise ValueError("a message that is not fresh or not authentic")
        self._last = sequence
        return signed[_SEQUENCE.size :]


class HubSide:
    """A hub with ``members`` members (ranks 1, 2, ...), each a spawned process, joined and
    ready; a call waits for every member's reply."""

    def __init__(self, context: Any, members: int = 1) -> None:
        secret = Secret.generate()
        self.listener = Listener(secret, host=HOST)
        self.bell = Doorbell()
        self.hub = Hub(self.listener, WAIT, self.bell, lambda failure: None)
        ranks = list(range(RANK, RANK + members))
        self.processes = [
            context.Process(target=_member, args=(self.listener.address, secret.hex(), rank))
            for rank in ranks
        ]
        for process in self.processes:
            process.start()
        self.hub.join(ranks, VERSION, WAIT, "the members did not start")
        for node in self.hub.nodes:
            self.hub.send_spec(node, f"node-{node.node_rank}", [node.node_rank], b"")
        self.hub.start()
        self.hub.ready = True
        self.hub.wake()
        self.poll = select.poll()
        self.poll.register(self.bell.fd, select.POLLIN)
        self.poll.register(self.hub.reply_fd, select.POLLIN)
        self.members = members
        self.seq = 0
        self._wait_replies()  # the members' ready frames

    def _wait_replies(self) -> None:
        hub = self.hub
        got = 0
        while True:
            hub.read_replies()
            while hub.inbox:
                hub.inbox.popleft()
                got += 1
            if got == self.members:
                return
            if not self.poll.poll(WAIT * 1000):
                raise TimeoutError("no reply from the members")
            self.bell.clear()

    def call(self, args: tuple[Any, ...]) -> None:
        self.seq += 1
        self.hub.broadcast(encode_call(-1, self.seq, "size", args, None)[0])
        self._wait_replies()

    def close(self) -> None:
        self.hub.broadcast(encode(KIND_STOP, True, -1, 0, None)[0])
        self.hub.stop(True, WAIT)
        for process in self.processes:
            process.join(WAIT)
        self.listener.close()
        self.bell.close()


class WireSide:
    """The raw wire: a ROUTER here, a DEALER in a spawned process; with ``authenticated``,
    every message sealed and checked (:class:`Sealer`)."""

    def __init__(self, context: Any, authenticated: bool = False) -> None:
        self.context: zmq.Context[Any] = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        port = self.router.bind_to_random_port(f"tcp://{HOST}")
        ours, theirs = context.Pipe()
        key = secrets.token_bytes(32) if authenticated else None
        self.seal = Sealer(key, b"call") if key else None
        self.check = Sealer(key, b"reply") if key else None
        self.process = context.Process(target=_wire, args=(port, theirs, key))
        self.process.start()
        ours.recv()
        self.peer, _hello = self.router.recv_multipart()
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)

    def call(self, args: tuple[Any, ...]) -> None:
        call = pickle.dumps(("size", args), protocol=5)
        self.router.send_multipart([self.peer, self.seal.seal(call) if self.seal else call])
        if not self.poller.poll(int(WAIT * 1000)):
            raise TimeoutError("no reply on the wire")
        _peer, reply = self.router.recv_multipart(copy=False)
        pickle.loads(self.check.open(reply.buffer) if self.check else reply.buffer)

    def close(self) -> None:
        self.router.send_multipart([self.peer, b"stop"])
        self.process.join(WAIT)
        self.router.close(linger=0)
        self.context.term()


def _read_exactly(sock: socket.socket, size: int, buffer: bytearray) -> memoryview:
    view = memoryview(buffer)[:size]
    got = 0
    while got < size:
        count = sock.recv_into(view[got:])
        if not count:
            raise EOFError("the peer closed its socket")
        got += count
    return view


def _tcp(port: int, key: bytes | None) -> None:
    sock = socket.create_connection((HOST, port), timeout=WAIT)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffer = bytearray(_TCP_BUFFER)
    seal = Sealer(key, b"reply") if key else None
    check = Sealer(key, b"call") if key else None
    while True:
        (size,) = _LENGTH.unpack(_read_exactly(sock, _LENGTH.size, buffer))
        if not size:
            break
        call = _read_exactly(sock, size, buffer)
        _method, args = pickle.loads(check.open(call) if check else call)
        answer = pickle.dumps(len(args[0]) if args else None, protocol=5)
        answer = seal.seal(answer) if seal else answer
        sock.sendall(_LENGTH.pack(len(answer)) + answer)
    sock.close()


class SocketSide:
    """A plain TCP socket (the standard library's), written and read by the calling thread
    at both ends: no I/O thread; each message its length, then itself. No authentication,
    or with ``authenticated`` every message sealed and checked (:class:`Sealer`)."""

    def __init__(self, context: Any, authenticated: bool = False) -> None:
        key = secrets.token_bytes(32) if authenticated else None
        self.seal = Sealer(key, b"call") if key else None
        self.check = Sealer(key, b"reply") if key else None
        with socket.create_server((HOST, 0)) as server:
            port = server.getsockname()[1]
            self.process = context.Process(target=_tcp, args=(port, key))
            self.process.start()
            server.settimeout(WAIT)
            self.sock, _ = server.accept()
        self.sock.settimeout(WAIT)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = bytearray(_TCP_BUFFER)

    def call(self, args: tuple[Any, ...]) -> None:
        call = pickle.dumps(("size", args), protocol=5)
        call = self.seal.seal(call) if self.seal else call
        self.sock.sendall(_LENGTH.pack(len(call)) + call)
        (size,) = _LENGTH.unpack(_read_exactly(self.sock, _LENGTH.size, self.buffer))
        reply = _read_exactly(self.sock, size, self.buffer)
        pickle.loads(self.check.open(reply) if self.check else reply)

    def close(self) -> None:
        self.sock.sendall(_LENGTH.pack(0))
        self.process.join(WAIT)
        self.sock.close()


def time_calls(call: Callable[[], object], calls: int) -> list[float]:
    """Seconds each of ``calls`` calls took, after a few to warm up."""
    for _ in range(min(100, calls)):
        call()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000, help="no-op calls a round and side")
    parser.add_argument("--rounds", type=int, default=4)
    options = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    sides: dict[str, HubSide | WireSide | SocketSide] = {"member": HubSide(context)}
    sides[AUTHENTICATED] = WireSide(context, authenticated=True)
    sides["pyzmq wire"] = WireSide(context)
    sides[AUTHENTICATED_TCP] = SocketSide(context, authenticated=True)
    sides["plain TCP socket"] = SocketSide(context)
    payloads = {"no-op": ((), options.calls), "1 MiB": ((b"x" * (1 << 20),), options.calls // 10)}
    results: dict[tuple[str, str], list[float]] = {}
    try:
        for round_ in range(options.rounds):
            order = list(sides.items())
            if round_ % 2:
                order.reverse()
            for payload, (args, calls) in payloads.items():
                for name, side in order:
                    if name in (AUTHENTICATED, AUTHENTICATED_TCP) and args:
                        continue  # see AUTHENTICATED
                    timed = time_calls(functools.partial(side.call, args), calls)
                    results.setdefault((payload, name), []).extend(timed)
    finally:
        for side in sides.values():
            side.close()
    print("| payload | side | median µs | p99 µs | ratio to the wire |")
    print("|---|---|---|---|---|")
    for payload in payloads:
        wire = statistics.median(results[(payload, "pyzmq wire")])
        for name in sides:
            if (payload, name) not in results:
                continue
            times = sorted(results[(payload, name)])
            median = statistics.median(times)
            p99 = times[int(len(times) * 0.99)]
            print(
                f"| {payload} | {name} | {median * 1e6:,.0f} | {p99 * 1e6:,.0f} | "
                f"{median / wire:.2f}x |"
            )


if __name__ == "__main__":
    main()
