"""The ``external_launcher`` backend: one rank per process, the processes started by torchrun."""

from __future__ import annotations

import os
import socket
from typing import ClassVar

from executor_core import Executor, ExecutorError
from executor_core.backend import Transport, WorkerContext

from ._executor import InProcessTransport

__all__ = ["TORCHRUN_ENV", "ExternalLauncherExecutor", "ExternalLauncherTransport"]

#: Variables torchrun sets in each process it starts; the backend reads its rank from them.
TORCHRUN_ENV: tuple[str, ...] = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _int_env(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ExecutorError(f"environment variable {name}={value!r} is not an integer") from None


class ExternalLauncherTransport(InProcessTransport):
    """This process's own rank, as torchrun's environment describes it."""

    def _context(self) -> WorkerContext:
        config = self.host.config
        missing = [name for name in TORCHRUN_ENV if not os.environ.get(name)]
        if missing:
            raise ExecutorError(
                "the 'external_launcher' backend runs inside processes started by torchrun, but "
                f"{', '.join(missing)} is not set; start the script with "
                f"'torchrun --nproc-per-node {config.world_size} script.py', or use backend='mp'"
            )
        world_size = _int_env("WORLD_SIZE")
        rank = _int_env("RANK")
        if world_size != config.world_size:
            raise ExecutorError(
                f"torchrun started {world_size} processes (WORLD_SIZE) but the config's "
                f"world_size is {config.world_size} (tp={config.tensor_parallel_size} x "
                f"pp={config.pipeline_parallel_size}); make them equal"
            )
        if not 0 <= rank < world_size:
            raise ExecutorError(f"RANK={rank} is outside 0..{world_size - 1}")
        local_world_size = (
            _int_env("LOCAL_WORLD_SIZE") if os.environ.get("LOCAL_WORLD_SIZE") else world_size
        )
        return self.host.context(
            rank,
            local_rank=_int_env("LOCAL_RANK"),
            local_world_size=local_world_size,
            node_id=socket.gethostname(),
            init_method="env://",
        )


class ExternalLauncherExecutor(Executor):
    """Runs this process's own rank, for processes started by an external launcher.

    Start the same script on every rank with ``torchrun --nproc-per-node N script.py``; each
    process creates this executor with the same config (``world_size`` = N x nodes). The rank
    comes from torchrun's ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``, and torch.distributed meets
    through ``env://`` (``MASTER_ADDR``/``MASTER_PORT``). Every process drives its own worker
    in the same order (SPMD), so the collectives between workers line up.

    ``collective_rpc`` runs the method on this process's worker only and returns a one-item
    list with its result, whatever ``unique_reply_rank`` says: a worker whose output every
    process needs must share it itself (the reference worker broadcasts its step output from
    the output rank). Calls, timeouts and ``non_block`` behave as in the ``uni`` backend.
    """

    transport_cls: ClassVar[type[Transport]] = ExternalLauncherTransport
