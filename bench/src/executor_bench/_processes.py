"""The lifetime of the baselines' worker processes: each starts in the ``spawn`` context
:data:`SPAWN`; :func:`stop_processes` ends them (joined, killed if one does not end by
itself)."""

from __future__ import annotations

import multiprocessing
from multiprocessing.process import BaseProcess

__all__ = ["SPAWN", "stop_processes"]

#: Seconds to wait for a process to end by itself before it is killed.
_JOIN_S = 10.0

SPAWN = multiprocessing.get_context("spawn")


def stop_processes(procs: list[BaseProcess]) -> None:
    for proc in procs:
        proc.join(_JOIN_S)
        if proc.is_alive():
            proc.kill()
            proc.join(_JOIN_S)
