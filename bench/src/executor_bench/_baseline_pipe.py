"""The ``Pipe`` baseline: one ``multiprocessing.Pipe`` to each of N spawned processes.

A call pickles ``(method, args)`` once (protocol 5), writes it to each worker in turn and
reads each reply: the cheapest general-purpose IPC there is in the standard library.
"""

from __future__ import annotations

import contextlib
import pickle
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from ._processes import SPAWN, stop_processes
from ._worker import answer

__all__ = ["PipeSide"]


def _pipe_reader(conn: Connection, rank: int, shared: bool) -> None:
    """A Pipe worker: answer each call until the empty message."""
    while True:
        data: Any = conn.recv() if shared else conn.recv_bytes()
        if not data:
            return
        method, args = data if shared else pickle.loads(data)
        result = answer(method, args, rank)
        if shared:
            conn.send(result)
        else:
            conn.send_bytes(pickle.dumps(result, protocol=5))


class PipeSide:
    """``multiprocessing.Pipe`` round trips to ``workers`` spawned processes. ``shared``:
    ``Connection.send`` instead of pickle-5 bytes, whose pickler has torch's reducers once
    torch is imported (a tensor's storage moves to shared memory once; a handle is sent)."""

    def __init__(self, workers: int, shared: bool = False) -> None:
        self._shared = shared
        self._conns: list[Connection] = []
        self._procs: list[BaseProcess] = []
        for rank in range(workers):
            here, there = SPAWN.Pipe()
            proc = SPAWN.Process(target=_pipe_reader, args=(there, rank, shared), daemon=True)
            proc.start()
            there.close()
            self._conns.append(here)
            self._procs.append(proc)

    def call(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        """Send the pickled call to each worker in turn, then read every reply."""
        if self._shared:
            for conn in self._conns:
                conn.send((method, args))
            return [conn.recv() for conn in self._conns]
        data = pickle.dumps((method, args), protocol=5)
        for conn in self._conns:
            conn.send_bytes(data)
        return [pickle.loads(conn.recv_bytes()) for conn in self._conns]

    def close(self) -> None:
        """Stop the workers."""
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(b"")
        stop_processes(self._procs)
        for conn in self._conns:
            conn.close()
