"""VllmWorker: the SDK's worker that hosts one of vLLM's own workers (``WorkerWrapperBase``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from executor_core import WorkerBase, WorkerContext

__all__ = ["VllmWorker"]


def _resolved(output: Any) -> Any:
    """A step's output as the engine takes it: vLLM's workers return an
    ``AsyncModelRunnerOutput`` under async scheduling, to be resolved in the worker."""
    get_output = getattr(output, "get_output", None)
    return output if get_output is None else get_output()


class VllmWorker(WorkerBase):
    """One rank of a vLLM engine on any SDK backend.

    :meth:`init_device` builds vLLM's worker (``WorkerWrapperBase``: ``init_worker`` then
    ``init_device``, which joins the engine's process groups through the rendezvous the SDK
    gives the rank); :meth:`load_model` loads its shard. Any other method the engine calls
    (``get_kv_cache_spec``, ``determine_available_memory``, ``initialize_from_config``,
    ``compile_or_warm_up_model``, ``take_draft_token_ids``, ...) is vLLM's worker's own,
    reached through attribute lookup; :attr:`vllm` is that worker, and what a callable given
    to ``LLM.collective_rpc`` receives.

    A tensor- or pipeline-parallel engine needs a process per rank (vLLM's parallel state
    is one per process): a backend that hosts several ranks in the engine's own process is
    refused here, before vLLM's worker is built.
    """

    def __init__(self, *, context: WorkerContext, vllm_config: Any, driver_pid: int) -> None:
        super().__init__(context=context)
        if context.world_size > 1 and os.getpid() == driver_pid:
            raise RuntimeError(
                f"backend {context.backend!r} runs rank {context.rank} in the engine's own "
                f"process, but vLLM needs a process per rank for {context.world_size} ranks "
                "(its parallel state is one per process): use a backend with worker "
                "processes (mp, ray, slurm) or tensor_parallel_size=1"
            )
        self._vllm_config = vllm_config
        #: vLLM's ``WorkerWrapperBase`` for this rank (None until :meth:`init_device`).
        self.vllm: Any = None

    def init_device(self) -> None:
        """Build vLLM's worker for this rank and initialise its device and process groups."""
        from threading import Lock, RLock

        from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no type information
        from vllm.v1.worker.worker_base import WorkerWrapperBase

        context = self.context
        # tqdm's default lock (vLLM's weight loading shows a bar) is a named semaphore, which
        # a killed rank leaves in /dev/shm; this rank's threads need only a thread lock.
        tqdm.set_lock(RLock())
        # The engine's node made this directory; another node may lack it.
        os.makedirs(os.environ.get("VLLM_RPC_BASE_PATH", "/tmp"), exist_ok=True)
        if context.world_size > 1:
            _bind_cpus(self._vllm_config, context.local_rank)
        wrapper = WorkerWrapperBase(rpc_rank=context.local_rank, global_rank=context.rank)
        kwargs: list[dict[str, Any]] = [{} for _ in range(context.local_rank + 1)]
        kwargs[context.local_rank] = {
            "vllm_config": self._vllm_config,
            "local_rank": context.local_rank,
            "rank": context.rank,
            "distributed_init_method": context.distributed_init_method,
            # The first rank of each tensor-parallel group, as vLLM's own executors say.
            "is_driver_worker": context.tp_rank == 0,
            # Guards the multimodal cache among this process's threads (vLLM's mp shares
            # one among processes; here no two ranks share a cache).
            "shared_worker_lock": Lock(),
        }
        wrapper.init_worker(kwargs)
        wrapper.init_device()  # type: ignore[no-untyped-call]  # vLLM leaves it unannotated
        self.vllm = wrapper

    def load_model(self) -> None:
        """Load this rank's shard of the model."""
        from vllm.platforms import current_platform

        self.vllm.load_model()
        current_platform.update_block_size_for_backend(self._vllm_config)

    def execute_model(self, batch: Any) -> Any:
        """One step of vLLM's scheduler (a ``SchedulerOutput``) on this rank."""
        return _resolved(self.vllm.execute_model(batch))

    def sample_tokens(self, grammar_output: Any) -> Any:
        """Sample the step's tokens (vLLM's second half of a step)."""
        return _resolved(self.vllm.sample_tokens(grammar_output))

    def sleep(self, level: int = 1) -> None:
        """vLLM's worker's ``sleep``."""
        self.vllm.sleep(level=level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """vLLM's worker's ``wake_up``."""
        self.vllm.wake_up(tags=None if tags is None else list(tags))

    def check_health(self) -> None:
        """vLLM's worker's ``check_health``."""
        self.vllm.check_health()

    def rejoin(self, context: WorkerContext) -> None:
        """Not supported: vLLM's worker cannot rebuild its process groups while it keeps its
        weights and KV cache (see the package's README, "Recovery")."""
        raise NotImplementedError(
            "a vLLM worker cannot rejoin a replaced rank's process groups; "
            "executor-vllm fails the engine instead"
        )

    def shutdown(self) -> None:
        """Shut vLLM's worker down (its process groups and shared memory)."""
        wrapper, self.vllm = self.vllm, None
        if wrapper is not None:
            wrapper.shutdown()
            from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

            # Unannotated in vLLM.
            destroy_model_parallel()  # type: ignore[no-untyped-call]
            destroy_distributed_environment()  # type: ignore[no-untyped-call]

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this class lacks: vLLM's worker's own methods.
        if name.startswith("_"):
            raise AttributeError(name)
        wrapper = self.__dict__.get("vllm")
        if wrapper is None:
            raise AttributeError(f"{type(self).__name__} has no {name!r} (vLLM's worker not built)")
        return getattr(wrapper, name)


def _bind_cpus(vllm_config: Any, local_rank: int) -> None:
    """On the CPU, bind this rank's threads to its cores as vLLM's own ``mp`` does
    (``VLLM_CPU_OMP_THREADS_BIND``: ``auto``, a ``|``-separated list per rank, or
    ``nobind``), before its OpenMP threads start."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    manager = OMPProcessManager(vllm_config)
    if manager.skip_setup or local_rank >= len(manager.cpu_lists):
        return
    cpus = manager.cpu_lists[local_rank]
    os.sched_setaffinity(0, cpus)
    import torch

    torch.set_num_threads(len(cpus))
