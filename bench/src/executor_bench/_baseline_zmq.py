"""The ``zmq`` baseline: a pyzmq PAIR socket over ipc (or TCP) to each of N spawned processes,
pickle protocol 5 (not in the default run; zmq is imported when the side starts)."""

from __future__ import annotations

import pickle
import shutil
import tempfile
from multiprocessing.process import BaseProcess
from typing import Any

from ._processes import SPAWN, stop_processes
from ._worker import answer

__all__ = ["ZmqSide"]


def _zmq_reader(address: str, rank: int) -> None:
    """A zmq worker: answer each call until the empty message."""
    import zmq

    sock: Any = zmq.Context.instance().socket(zmq.PAIR)
    sock.connect(address)
    while data := sock.recv(copy=False).buffer:
        method, args = pickle.loads(data)
        sock.send(pickle.dumps(answer(method, args, rank), protocol=5), copy=False)
    sock.close(linger=0)


class ZmqSide:
    """A pyzmq PAIR socket over ipc to each of ``workers`` spawned processes, pickle 5; over
    TCP on ``tcp_host`` (a loopback address: another "node"'s wire, without authentication)
    if given."""

    def __init__(self, workers: int, tcp_host: str | None = None) -> None:
        import zmq

        self._dir = tempfile.mkdtemp(prefix="executor-bench-zmq-")
        self._context = zmq.Context()
        self._socks: list[Any] = []
        self._procs: list[BaseProcess] = []
        for rank in range(workers):
            sock = self._context.socket(zmq.PAIR)
            if tcp_host is None:
                address = f"ipc://{self._dir}/w{rank}"
                sock.bind(address)
            else:
                port = sock.bind_to_random_port(f"tcp://{tcp_host}")
                address = f"tcp://{tcp_host}:{port}"
            proc = SPAWN.Process(target=_zmq_reader, args=(address, rank), daemon=True)
            proc.start()
            self._socks.append(sock)
            self._procs.append(proc)

    def call(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        """Send the pickled call on each socket in turn, then read every reply."""
        data = pickle.dumps((method, args), protocol=5)
        for sock in self._socks:
            sock.send(data, copy=False)
        return [pickle.loads(sock.recv(copy=False).buffer) for sock in self._socks]

    def close(self) -> None:
        """Stop the workers; the sockets go with the directory."""
        for sock in self._socks:
            sock.send(b"")
        stop_processes(self._procs)
        for sock in self._socks:
            sock.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)
