"""The vLLM baselines: vLLM's shared-memory ``MessageQueue`` (``shm_broadcast.py``) from this
process to N reader processes.

One writer (this process) and N reader processes at the constructor's defaults; readers
dequeue as vLLM's worker loop does and reply through a Pipe, the faster of the two ways here
for a small call (the driver sleeps in the Pipe's read instead of spinning beside the
readers), or (``own_replies``) through a ``MessageQueue`` of their own, as vLLM's
multiprocess executor lays it out. Only if vLLM's ``shm_broadcast`` imports: from an
installed ``vllm``, or from ``--vllm-path DIR``. Its readers spin for a second after each
read, so the run lets them settle before timing another side.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import os
import pickle
import shutil
import sys
import tempfile
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from ._processes import SPAWN, stop_processes
from ._worker import answer

__all__ = ["SHM_MODULE", "VllmQueueSide", "describe_vllm", "import_vllm"]

#: The module of vLLM that holds the MessageQueue.
SHM_MODULE = "vllm.distributed.device_communicators.shm_broadcast"
_SHM_FILE = os.path.join(*SHM_MODULE.split(".")) + ".py"
#: What a reader sends when it stops (never a pickled reply: those start with b"\x80").
_BYE = b"bye"
#: Seconds to wait for a vLLM reader's reply-queue handle (it imports vLLM's module first).
_HANDLE_S = 60.0


def import_vllm(path: str | None) -> Any:
    """vLLM's ``shm_broadcast`` module, from ``path`` or from an installed vllm.

    ``path`` is a directory holding ``vllm/distributed/device_communicators/
    shm_broadcast.py`` (a vllm install's site-packages, or a copy of that file with
    stand-ins for the few vllm modules it imports); it is put first on ``sys.path``, which
    spawned readers inherit. Raises LookupError saying why the module cannot be used.
    """
    if path is None:
        if importlib.util.find_spec("vllm") is None:
            raise LookupError("vllm is not installed and no --vllm-path was given")
    else:
        path = os.path.abspath(path)
        if not os.path.isfile(os.path.join(path, _SHM_FILE)):
            raise LookupError(f"--vllm-path {path} holds no {_SHM_FILE}")
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        module = importlib.import_module(SHM_MODULE)
        module.MessageQueue  # noqa: B018  (fail here, not in a reader)
    except Exception as exc:  # whatever stops it, the baseline is skipped with the reason
        where = f"from {path}" if path else "from the installed vllm"
        raise LookupError(f"cannot import {SHM_MODULE} {where}: {exc!r}") from exc
    return module


def describe_vllm(module: Any) -> str:
    """``vllm 0.x (DIR)``: which vLLM the baseline runs, and from where."""
    vllm = sys.modules.get("vllm")
    version = getattr(vllm, "__version__", None) or "(version unknown)"
    path = os.path.abspath(module.__file__)
    root = path[: -len(_SHM_FILE)].rstrip(os.sep) if path.endswith(_SHM_FILE) else path
    return f"vllm {version} ({root})"


def _vllm_reader(
    handle: Any, rank: int, conn: Connection, own_replies: bool, remote_ip: str | None
) -> None:
    """A vLLM reader: dequeue as vLLM's worker loop does; reply through ``conn``, or through
    a queue of its own (its handle goes to the writer over ``conn`` first). With
    ``remote_ip`` it is a remote reader (its calls come over TCP) and its reply queue's one
    reader is remote too, as vLLM lays out a rank on another node."""
    shm_broadcast = importlib.import_module(SHM_MODULE)
    queue = shm_broadcast.MessageQueue.create_from_handle(handle, rank)
    replies = None
    if own_replies:
        local = 0 if remote_ip is not None else 1
        replies = shm_broadcast.MessageQueue(1, local, connect_ip=remote_ip)
        conn.send(replies.export_handle())
    queue.wait_until_ready()
    if replies is not None:
        replies.wait_until_ready()
    try:
        while True:
            message = queue.dequeue(indefinite=True)
            if message is None:
                return
            method, args = message
            result = answer(method, args, rank)
            del message, args
            if replies is not None:
                replies.enqueue(result)
            else:
                conn.send_bytes(pickle.dumps(result, protocol=5))
    finally:
        conn.send_bytes(_BYE)
        del queue, replies  # a queue's creator unlinks its ring when it is collected
        gc.collect()


def _recv_handle(conn: Connection) -> Any:
    """A reader's reply-queue handle; a reader that died before sending it is an error."""
    if not conn.poll(_HANDLE_S):
        raise RuntimeError(f"a vLLM reader sent no reply queue within {_HANDLE_S:g} s")
    return conn.recv()


class VllmQueueSide:
    """vLLM's ``MessageQueue`` from this process to ``workers`` reader processes; replies
    come through a Pipe each, or (``own_replies``) through a queue of each reader's.
    ``max_chunk_bytes``: the call queue's chunk (None: the constructor's default).
    ``remote_ranks`` are remote readers, as on another node: their calls travel over TCP on
    ``remote_ip`` (a loopback address here), and so do their replies with ``own_replies``."""

    def __init__(
        self,
        workers: int,
        own_replies: bool = False,
        max_chunk_bytes: int | None = None,
        remote_ranks: tuple[int, ...] = (),
        remote_ip: str = "127.0.0.1",
    ) -> None:
        shm_broadcast = importlib.import_module(SHM_MODULE)
        # vLLM puts its zmq ipc sockets under VLLM_RPC_BASE_PATH: a directory of this side's.
        self._ipc_dir = tempfile.mkdtemp(prefix="executor-bench-vllm-")
        before = os.environ.get("VLLM_RPC_BASE_PATH")
        os.environ["VLLM_RPC_BASE_PATH"] = self._ipc_dir
        self._conns: list[Connection] = []
        self._procs: list[BaseProcess] = []
        self._replies: list[Any] = []
        try:
            extra: dict[str, Any] = {}
            if max_chunk_bytes is not None:
                extra["max_chunk_bytes"] = max_chunk_bytes
            local = [rank for rank in range(workers) if rank not in remote_ranks]
            if remote_ranks:
                extra.update(local_reader_ranks=local, connect_ip=remote_ip)
            self._queue = shm_broadcast.MessageQueue(workers, len(local), **extra)
            self._rings = [] if self._queue.buffer is None else [self._ring(self._queue)]
            for rank in range(workers):
                here, there = SPAWN.Pipe()
                proc = SPAWN.Process(
                    target=_vllm_reader,
                    args=(
                        self._queue.export_handle(),
                        rank,
                        there,
                        own_replies,
                        remote_ip if rank in remote_ranks else None,
                    ),
                    daemon=True,
                )
                proc.start()
                there.close()
                self._conns.append(here)
                self._procs.append(proc)
            handles = [_recv_handle(conn) for conn in self._conns] if own_replies else []
            self._queue.wait_until_ready()
            for handle in handles:
                replies = shm_broadcast.MessageQueue.create_from_handle(handle, 0)
                if replies.buffer is not None:  # a remote reply queue has no ring here
                    self._rings.append(self._ring(replies))
                replies.wait_until_ready()
                self._replies.append(replies)
        finally:
            if before is None:
                os.environ.pop("VLLM_RPC_BASE_PATH", None)
            else:
                os.environ["VLLM_RPC_BASE_PATH"] = before

    @staticmethod
    def _ring(queue: Any) -> str:
        return str(queue.buffer.shared_memory.name)

    def call(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        """Enqueue the call once; read each reader's reply."""
        self._queue.enqueue((method, args))
        if self._replies:
            return [replies.dequeue() for replies in self._replies]
        return [pickle.loads(conn.recv_bytes()) for conn in self._conns]

    def close(self) -> None:
        """Stop the readers; the ring goes with the queue, the sockets with the directory."""
        with contextlib.suppress(Exception):  # readers already gone: nothing to tell them
            self._queue.enqueue(None)
        for conn in self._conns:
            with contextlib.suppress(EOFError, OSError):
                while conn.recv_bytes() != _BYE:
                    pass
        stop_processes(self._procs)
        for conn in self._conns:
            conn.close()
        # A ring's creator unlinks it when collected (vLLM's ShmRingBuffer.__del__): this
        # process's queue here, each reader's reply queue in that reader.
        del self._queue, self._replies
        gc.collect()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
        for ring in self._rings:
            leftover = f"/dev/shm/{ring.lstrip('/')}"
            if os.path.exists(leftover):
                with contextlib.suppress(OSError):
                    os.unlink(leftover)
