"""The baselines: what the backends are measured against, with nothing of the SDK in between.

* ``Pipe``: one ``multiprocessing.Pipe`` to each of N spawned processes; a call pickles
  ``(method, args)`` once (protocol 5), writes it to each worker in turn and reads each
  reply. The cheapest general-purpose IPC there is in the standard library.
* ``Ray actors``: N plain Ray actors; a call is ``ray.get([a.method.remote(...) ...])``, and
  a payload is ``ray.put`` once, its ref passed to every actor (the data enters the object
  store once, as it enters a backend's ring once). Only if ray imports.
* ``vLLM MQ``: vLLM's shared-memory ``MessageQueue`` (``shm_broadcast.py``) with one writer
  (this process) and N reader processes at the constructor's defaults; readers dequeue as
  vLLM's worker loop does and reply through a Pipe, the faster of the two ways here for a
  small call (the driver sleeps in the Pipe's read instead of spinning beside the readers).
  Only if vLLM's ``shm_broadcast`` imports: from an installed ``vllm``, or from
  ``--vllm-path DIR``. Its readers spin for a second after each read, so the run lets them
  settle before timing another side.
* ``vLLM MQ, own replies``: the same, laid out as vLLM's multiprocess executor lays it out:
  each reader replies through a ``MessageQueue`` of its own, back to this process.
* ``vLLM MQ, 16 MiB chunk``: as ``vLLM MQ``, with the 16 MiB chunk vLLM's executor sets
  (``VLLM_MQ_MAX_CHUNK_BYTES_MB``): a 16 MiB tensor overflows to its zmq socket.
* ``zmq``: a pyzmq PAIR socket over ipc to each of N spawned processes, pickle protocol 5
  (not in the default run).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import importlib.metadata
import importlib.util
import multiprocessing
import os
import pickle
import platform
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from ._options import BASELINES, MIB
from ._sides import Side, SideSpec, Skipped
from ._worker import answer, make, size_of

__all__ = [
    "SHM_MODULE",
    "PipeSide",
    "RawActor",
    "RayActorsSide",
    "VllmQueueSide",
    "ZmqSide",
    "describe_vllm",
    "import_vllm",
    "select_baselines",
]

#: The module of vLLM that holds the MessageQueue.
SHM_MODULE = "vllm.distributed.device_communicators.shm_broadcast"
_SHM_FILE = os.path.join(*SHM_MODULE.split(".")) + ".py"
#: Seconds to wait for a process to end by itself before it is killed.
_JOIN_S = 10.0
#: What a reader sends when it stops (never a pickled reply: those start with b"\x80").
_BYE = b"bye"
#: Seconds to wait for a vLLM reader's reply-queue handle (it imports vLLM's module first).
_HANDLE_S = 60.0

_SPAWN = multiprocessing.get_context("spawn")


def _stop_processes(procs: list[BaseProcess]) -> None:
    for proc in procs:
        proc.join(_JOIN_S)
        if proc.is_alive():
            proc.kill()
            proc.join(_JOIN_S)


# --- Pipe --------------------------------------------------------------------------------


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
            here, there = _SPAWN.Pipe()
            proc = _SPAWN.Process(target=_pipe_reader, args=(there, rank, shared), daemon=True)
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
        _stop_processes(self._procs)
        for conn in self._conns:
            conn.close()


# --- zmq -------------------------------------------------------------------------------------


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
    """A pyzmq PAIR socket over ipc to each of ``workers`` spawned processes, pickle 5."""

    def __init__(self, workers: int) -> None:
        import zmq

        self._dir = tempfile.mkdtemp(prefix="executor-bench-zmq-")
        self._context = zmq.Context()
        self._socks: list[Any] = []
        self._procs: list[BaseProcess] = []
        for rank in range(workers):
            address = f"ipc://{self._dir}/w{rank}"
            sock = self._context.socket(zmq.PAIR)
            sock.bind(address)
            proc = _SPAWN.Process(target=_zmq_reader, args=(address, rank), daemon=True)
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
        _stop_processes(self._procs)
        for sock in self._socks:
            sock.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)


# --- raw Ray actors ------------------------------------------------------------------------


class RawActor:
    """The Ray baseline's actor: the worker's methods, no executor in between."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank

    def noop(self) -> None:
        """Return at once."""
        return None

    def size_of(self, payload: Any) -> int:
        """The payload's size."""
        return size_of(payload)

    def make(self, nbytes: int, on_rank: int) -> bytes | None:
        """``nbytes`` bytes from rank ``on_rank``, None from the others."""
        return make(self.rank, nbytes, on_rank)

    def execute_model(self, batch: Any) -> Any:
        """Return ``batch``."""
        return batch

    def node_id(self) -> str:
        """The Ray node the actor runs on."""
        import ray

        return str(ray.get_runtime_context().get_node_id())


class RayActorsSide:
    """``workers`` plain Ray actors, in the Ray session this process holds.

    ``put_once``: a payload is ``ray.put`` once per call and its ref passed to every actor;
    otherwise the value is passed to each (Ray puts one over 100 KiB per actor call).
    ``options``: ``ray.remote`` options, for every actor or (a list) one dict per actor.
    """

    def __init__(
        self,
        workers: int,
        put_once: bool = True,
        options: dict[str, Any] | Sequence[dict[str, Any]] = (),
    ) -> None:
        import ray

        self._put_once = put_once
        each = [options] * workers if isinstance(options, dict) else list(options)
        # No CPU reserved by default: the run's Ray instance is sized for the ray backend's
        # workers, which reserve theirs, and both sides' processes are alive at once.
        each = [{"num_cpus": 0, **(each[rank] if each else {})} for rank in range(workers)]
        # Concurrency groups are the class's: ray.remote takes them, .options() does not.
        groups = {k: v for k, v in each[0].items() if k == "concurrency_groups"}
        actor_cls: Any = ray.remote(**groups)(RawActor) if groups else ray.remote(RawActor)
        self.actors = [
            actor_cls.options(**{k: v for k, v in opts.items() if k not in groups}).remote(rank)
            for rank, opts in enumerate(each)
        ]
        ray.get([actor.noop.remote() for actor in self.actors])

    def call(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        """``ray.get`` of each actor's ``method.remote(*args)``."""
        import ray

        if self._put_once:
            args = tuple(ray.put(arg) for arg in args)
        return list(ray.get([getattr(actor, method).remote(*args) for actor in self.actors]))

    def close(self) -> None:
        """Kill the actors (Ray's own processes stay: the run's Ray session owns them)."""
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors.clear()


# --- vLLM's MessageQueue -------------------------------------------------------------------


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


def _vllm_reader(handle: Any, rank: int, conn: Connection, own_replies: bool) -> None:
    """A vLLM reader: dequeue as vLLM's worker loop does; reply through ``conn``, or through
    a queue of its own (its handle goes to the writer over ``conn`` first)."""
    shm_broadcast = importlib.import_module(SHM_MODULE)
    queue = shm_broadcast.MessageQueue.create_from_handle(handle, rank)
    replies = None
    if own_replies:
        replies = shm_broadcast.MessageQueue(1, 1)
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
    ``max_chunk_bytes``: the call queue's chunk (None: the constructor's default)."""

    def __init__(
        self, workers: int, own_replies: bool = False, max_chunk_bytes: int | None = None
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
            extra = {} if max_chunk_bytes is None else {"max_chunk_bytes": max_chunk_bytes}
            self._queue = shm_broadcast.MessageQueue(workers, workers, **extra)
            self._rings = [str(self._queue.buffer.shared_memory.name)]
            for rank in range(workers):
                here, there = _SPAWN.Pipe()
                proc = _SPAWN.Process(
                    target=_vllm_reader,
                    args=(self._queue.export_handle(), rank, there, own_replies),
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
                self._rings.append(str(replies.buffer.shared_memory.name))
                replies.wait_until_ready()
                self._replies.append(replies)
        finally:
            if before is None:
                os.environ.pop("VLLM_RPC_BASE_PATH", None)
            else:
                os.environ["VLLM_RPC_BASE_PATH"] = before

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
        _stop_processes(self._procs)
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


# --- selection ------------------------------------------------------------------------------


def select_baselines(
    requested: list[str], workers: int, vllm_path: str | None
) -> tuple[list[SideSpec], list[Skipped]]:
    """The baselines of ``requested`` (keys of ``BASELINES``) that can run here, and those
    skipped with the reason."""
    sides: list[SideSpec] = []
    skipped: list[Skipped] = []
    for key in requested:
        name = BASELINES[key]
        if key == "pipe":
            sides.append(
                SideSpec(
                    name,
                    "baseline",
                    workers,
                    _PIPE_NOTE,
                    _starter(PipeSide, workers),
                    version=f"Python {platform.python_version()}",
                )
            )
        elif key == "ray":
            if importlib.util.find_spec("ray") is None:
                skipped.append(Skipped(name, "baseline", "ray is not installed (pip install ray)"))
                continue
            sides.append(
                SideSpec(
                    name,
                    "baseline",
                    workers,
                    _RAY_NOTE,
                    _starter(RayActorsSide, workers),
                    needs_ray=True,
                    version=f"ray {importlib.metadata.version('ray')}",
                )
            )
        elif key == "zmq":
            if importlib.util.find_spec("zmq") is None:
                skipped.append(Skipped(name, "baseline", "pyzmq is not installed"))
                continue
            sides.append(
                SideSpec(
                    name,
                    "baseline",
                    workers,
                    _ZMQ_NOTE,
                    _starter(ZmqSide, workers),
                    version=f"pyzmq {importlib.metadata.version('pyzmq')}",
                )
            )
        else:
            try:
                module = import_vllm(vllm_path)
            except LookupError as exc:
                skipped.append(Skipped(name, "baseline", str(exc)))
                continue
            own_replies = key == "vllm-own"
            chunk = 16 * MIB if key == "vllm-16m" else None
            sides.append(
                SideSpec(
                    name,
                    "baseline",
                    workers,
                    _VLLM_NOTES[key],
                    functools.partial(VllmQueueSide, workers, own_replies, chunk),
                    spins=True,
                    version=describe_vllm(module),
                )
            )
    return sides, skipped


_PIPE_NOTE = "pickle protocol 5, written to each worker's Pipe in turn"
_RAY_NOTE = (
    "actor.method.remote() + ray.get; a payload is ray.put once, its ref to each actor; "
    "shutdown is ray.kill, which returns before the actors have exited"
)
_ZMQ_NOTE = "a PAIR socket over ipc to each worker, pickle protocol 5"
_VLLM_NOTES = {
    "vllm": "constructor defaults; readers reply through a Pipe; they spin 1 s after a read",
    "vllm-own": "constructor defaults; readers reply through a MessageQueue each, as in "
    "vLLM's executor; they spin 1 s after a read",
    "vllm-16m": "16 MiB chunks, as vLLM's executor sets them (a larger message overflows "
    "to its zmq socket); readers reply through a Pipe; they spin 1 s after a read",
}


def _starter(cls: Callable[[int], Side], workers: int) -> Callable[[], Side]:
    def start() -> Side:
        return cls(workers)

    return start
