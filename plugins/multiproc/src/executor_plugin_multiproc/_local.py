"""Start the worker processes of one node, fed by that node's shared-memory channel.

The driver does this for the ranks on its own machine, and a node agent (``executor node``)
for the ranks on its machine: one code path, so a worker cannot tell which started it.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import sys
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess

import attrs

from executor_channel import NodeRings, WorkerFds
from executor_core import ConfigError
from executor_core.backend import WorkerWrapper

from ._group import DeathCallback, WorkerGroup
from ._options import MultiprocOptions
from ._probe import Probes
from ._process import InheritedFd, WorkerSpec, worker_main
from ._spare import Spare, SpareSpec

logger = logging.getLogger("executor_plugin_multiproc")

__all__ = ["WorkerLaunch", "check_devices", "default_env", "replace_workers", "start_workers"]


@attrs.frozen
class WorkerLaunch:
    """What one worker process is started with: its place in the job, its wrapper, pickled
    (portable: it loads its own hooks), and the config's environment (``ExecutorConfig.env``).
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    wrapper: bytes
    config_env: dict[str, str]

    @classmethod
    def of(cls, wrapper: WorkerWrapper, config_env: dict[str, str]) -> WorkerLaunch:
        """The launch of ``wrapper``'s worker (made portable and pickled here)."""
        context = wrapper.context
        return cls(
            rank=context.rank,
            local_rank=context.local_rank,
            world_size=context.world_size,
            local_world_size=context.local_world_size,
            wrapper=pickle.dumps(wrapper.portable(), protocol=5),
            config_env=dict(config_env),
        )


def default_env(launch: WorkerLaunch) -> dict[str, str]:
    """The torchrun-style variables of the worker's rank, an OpenMP thread count that shares
    this machine's cores between its workers, then the config's env over both."""
    env = {
        "RANK": str(launch.rank),
        "LOCAL_RANK": str(launch.local_rank),
        "WORLD_SIZE": str(launch.world_size),
        "LOCAL_WORLD_SIZE": str(launch.local_world_size),
    }
    config_env = launch.config_env
    if "OMP_NUM_THREADS" not in config_env and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        workers = max(1, launch.local_world_size)
        env["OMP_NUM_THREADS"] = str(max(1, (cores or os.cpu_count() or 1) // workers))
    env.update(config_env)
    return env


#: The variables of one rank in :func:`default_env` (a spare gets them at its hand-over).
_RANK_VARIABLES = ("RANK", "LOCAL_RANK")


class _Starter:
    """Makes the worker processes of one node's channel: at start, and for a rank
    replacement (the same descriptors, a new launch, in a new process or a spare)."""

    def __init__(
        self,
        channel: NodeRings,
        options: MultiprocOptions,
        death_r: int,
        death_w: int,
        probes: Probes,
    ) -> None:
        self.channel = channel
        self.options = options
        self.death_r = death_r
        self.death_w = death_w
        self.probes = probes
        self.ctx = multiprocessing.get_context(options.start_method)
        self.parent_pid = os.getpid() if options.start_method != "forkserver" else None

    def process(self, index: int, launch: WorkerLaunch) -> BaseProcess:
        process: BaseProcess = self.ctx.Process(  # type: ignore[attr-defined]  # every context has Process
            target=worker_main,
            args=(self.spec(index, launch),),
            name=f"executor-mp-worker-{launch.rank}",
            daemon=True,
        )
        return process

    def spare(self, launch: WorkerLaunch, preload: tuple[str, ...]) -> Spare:
        """A spare for this node (``launch``: any of its ranks', for the node's env)."""
        env = {k: v for k, v in default_env(launch).items() if k not in _RANK_VARIABLES}
        spec = SpareSpec(
            env=env,
            preload=preload,
            handover=InheritedFd(-1),  # Spare's own socket
            death_pipe=InheritedFd(self.death_r),
            parent_pid=self.parent_pid,
        )
        return Spare(self.ctx, spec)

    def replacement(
        self, index: int, launch: WorkerLaunch, spare: Spare | None
    ) -> Callable[[], BaseProcess]:
        """``start()`` for ``WorkerGroup.respawn``: hand the rank to ``spare``, or (without
        one, or if the hand-over fails) start a new process."""

        def start() -> BaseProcess:
            if spare is not None:
                try:
                    return spare.hand_over(self.spec(index, launch))
                except OSError as exc:
                    logger.warning("rank %d: a new process, the spare failed: %s", launch.rank, exc)
                    spare.stop()
            process = self.process(index, launch)
            process.start()
            return process

        return start

    def spec(self, index: int, launch: WorkerLaunch) -> WorkerSpec:
        options = self.options
        forked = options.start_method == "fork"
        return WorkerSpec(
            rank=launch.rank,
            wrapper=launch.wrapper,
            env=default_env(launch),
            layout=self.channel.layout,
            index=index,
            death_pipe=InheritedFd(self.death_r),
            parent_pid=self.parent_pid,
            spin_s=options.spin_s,
            idle_spin_s=options.idle_spin_s,
            probe=InheritedFd(self.probes.theirs[index].fileno()),
            close_fds=(self.death_w, *self.probes.fds()) if forked else (),
            **_inherited(self.channel.worker_fds(index)),
        )


def start_workers(
    channel: NodeRings,
    launches: Sequence[WorkerLaunch],
    options: MultiprocOptions,
    add_cleanup: Callable[[Callable[[], None]], None],
    on_death: DeathCallback,
    spares: int = 0,
    preload: tuple[str, ...] = (),
) -> WorkerGroup:
    """Start one process per launch on this node's ``channel`` (the i-th reads its i-th
    rings); return once the processes exist (not once they are ready).

    ``on_death(index, exitcode)`` is called from the monitor thread when worker ``index``
    ends while the group is armed. Everything made is handed to ``add_cleanup``. The group
    keeps ``spares`` warm spares (``_spare``: importing ``preload``) once told
    (``WorkerGroup.start_spares``); never with fork, where they would save nothing.
    """
    # Workers read the death pipe; it reaches EOF when this process dies, however it dies.
    # The read end stays open here for the processes of a rank replacement.
    death_r, death_w = os.pipe()
    add_cleanup(_fd_closer(death_w))
    add_cleanup(_fd_closer(death_r))
    probes = Probes(len(launches))
    add_cleanup(probes.close)
    starter = _Starter(channel, options, death_r, death_w, probes)
    try:
        processes = [starter.process(index, launch) for index, launch in enumerate(launches)]
        # The monitor holds the callback's owner (the transport or the agent), never the
        # executor.
        group = WorkerGroup(processes, on_death, probes)
        group.start()
    finally:
        probes.handed_over()  # the children hold their copies
    group.starter = starter
    if spares and options.start_method != "fork":
        group.spares_wanted = spares
        group.make_spare = lambda: starter.spare(launches[0], preload)
    return group


def replace_workers(
    channel: NodeRings, group: WorkerGroup, launches: Sequence[WorkerLaunch], first_rank: int
) -> list[tuple[int, BaseException]]:
    """Rank replacement on this node: a spare or a new process for each launch (its rank's
    old one is gone), on the same rings, reset so that it reads from the next call written
    and writes into an empty reply ring, with a new liveness probe; return once they are
    started.
    Returns the ranks that could not be replaced, with why (the others are started)."""
    failed: list[tuple[int, BaseException]] = []
    starter = group.starter
    assert isinstance(starter, _Starter)
    for launch in launches:
        index = launch.rank - first_rank
        try:
            channel.resume_worker(index)
            group.probes.renew(index)
            spare = group.take_spare()
            try:
                group.respawn(index, starter.replacement(index, launch, spare))
            finally:
                if spare is not None:
                    spare.stop()  # unless it runs the rank now
                group.probes.handed_over(index)
        except Exception as exc:  # noqa: BLE001 - returned: the caller reports it as a death
            failed.append((launch.rank, exc))
    return failed


def _inherited(fds: WorkerFds) -> dict[str, InheritedFd]:
    """The ``WorkerSpec`` fields that hand ``fds`` to a worker process."""
    return {name: InheritedFd(fd) for name, fd in attrs.asdict(fds).items()}


def _fd_closer(fd: int) -> Callable[[], None]:
    def close() -> None:
        with contextlib.suppress(OSError):
            os.close(fd)

    return close


def check_devices(
    options: MultiprocOptions, device: str, workers: int, env: dict[str, str]
) -> None:
    """Refuse, before any worker starts, what would fail in the workers: fork once CUDA is
    initialised here (a forked child cannot use CUDA), or fewer GPUs than workers."""
    torch = sys.modules.get("torch")
    if options.start_method == "fork" and torch is not None and torch.cuda.is_initialized():
        raise ConfigError(
            "backend_options",
            {"start_method": "fork"},
            "CUDA is already initialised in this process, and a forked worker cannot use it "
            "('Cannot re-initialize CUDA in forked subprocess'); use start_method='spawn' "
            "(the default) or 'forkserver'",
        )
    if device == "cuda":
        from executor_core.torch import check_gpu_per_local_rank  # imports torch: cuda only

        check_gpu_per_local_rank(workers, env)
