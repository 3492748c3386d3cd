"""The ``backend_options`` the mp backend understands, validated into :class:`MultiprocOptions`."""

from __future__ import annotations

import attrs

from executor_channel import ChannelOptions
from executor_core.options import integer, number, one_of, option

__all__ = ["MultiprocOptions"]

_MIB = 1 << 20


@attrs.frozen(kw_only=True)
class MultiprocOptions(ChannelOptions):
    """Knobs of the mp backend, read from ``ExecutorConfig.backend_options``: the channel's
    (:class:`~executor_channel.ChannelOptions`: ring sizes, spinning, heartbeats)
    and its own. ``MultiprocExecutor.options_cls``: the core refuses any other key."""

    #: How worker processes are started: "spawn" (default), "forkserver", or "fork" (only
    #: safe if the driver has no threads holding locks and no CUDA context yet).
    start_method: str = option("spawn", one_of("spawn", "forkserver", "fork"))
    #: Seconds to wait for every worker to report ready (``init_device`` + ``load_model``).
    startup_timeout: float = option(600.0, number(above=0.0))
    #: Seconds workers get to exit after the stop message before SIGTERM, and again before
    #: SIGKILL.
    shutdown_grace_s: float = option(5.0, number(at_least=0.0))
    #: With a recovery policy (``ExecutorConfig.recovery``): idle worker processes each node
    #: keeps started, the worker class's module imported, for a rank replacement to take
    #: over instead of starting a process (``_spare``). 0: none. Ignored with "fork".
    spare_workers: int = option(1, integer(at_least=0, at_most=64))

    #: With ``num_nodes > 1``: the TCP port on which the driver waits for the node agents
    #: (``executor node --master-port``), on ``ExecutorConfig.distributed_host``.
    node_port: int = option(29550, integer(at_least=1, at_most=65535))
