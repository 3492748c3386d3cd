"""Which baselines a run measures: of those asked for, each that can run here as a
:class:`SideSpec`, each that cannot as :class:`Skipped`, with the reason.

The baselines are what the backends are measured against, with nothing of the SDK in
between, one module each:

* ``Pipe`` (``_baseline_pipe.py``): one ``multiprocessing.Pipe`` to each of N spawned
  processes, ``(method, args)`` pickled once (protocol 5).
* ``Ray actors`` (``_baseline_ray.py``): N plain Ray actors; a payload is ``ray.put`` once,
  its ref passed to every actor. Only if ray imports.
* ``vLLM MQ`` (``_baseline_vllm.py``): vLLM's shared-memory ``MessageQueue`` from this
  process to N reader processes, which reply through a Pipe. Only if vLLM's
  ``shm_broadcast`` imports (an installed ``vllm``, or ``--vllm-path DIR``).
* ``vLLM MQ, own replies``: the same, laid out as vLLM's multiprocess executor lays it out:
  each reader replies through a ``MessageQueue`` of its own, back to this process.
* ``vLLM MQ, 16 MiB chunk``: as ``vLLM MQ``, with the 16 MiB chunk vLLM's executor sets
  (``VLLM_MQ_MAX_CHUNK_BYTES_MB``): a 16 MiB tensor overflows to its zmq socket.
* ``zmq`` (``_baseline_zmq.py``): a pyzmq PAIR socket over ipc to each of N spawned
  processes, pickle protocol 5 (not in the default run).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import platform
from collections.abc import Callable

from ._baseline_pipe import PipeSide
from ._baseline_ray import RayActorsSide
from ._baseline_vllm import VllmQueueSide, describe_vllm, import_vllm
from ._baseline_zmq import ZmqSide
from ._options import BASELINES, MIB
from ._sides import Side, SideSpec, Skipped

__all__ = ["select_baselines"]


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
