"""SdkExecutor: a vLLM ``Executor`` whose workers run on any installed SDK backend."""

from __future__ import annotations

import contextlib
import functools
import glob
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import vllm

from executor_core import ExecutorConfig, ExecutorFailedError, create_executor

from ._settings import check_vllm_version, read_settings

check_vllm_version(vllm.__version__)  # before vLLM's executor seam is used

import vllm.envs as vllm_envs  # noqa: E402 - after the version check
from vllm.platforms import current_platform  # noqa: E402
from vllm.v1.executor.abstract import Executor  # noqa: E402

__all__ = ["SdkExecutor"]

_log = logging.getLogger("executor_vllm")

#: Prefixes of the engine's environment variables every worker gets: backends that start
#: workers elsewhere (Ray actors, Slurm steps) do not pass the engine's environment on.
_FORWARDED_ENV = ("VLLM_", "HF_", "TRANSFORMERS_", "TOKENIZERS_")


def _on_vllm_worker(fn: Callable[..., Any], worker: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a callable of ``LLM.collective_rpc`` on vLLM's worker, as vLLM's executors do."""
    return fn(worker.vllm, *args, **kwargs)


def _shm_patterns(worker: Any) -> list[str]:
    """The /dev/shm names (glob patterns) of the segments vLLM's worker made on this rank: its
    CPU communicator's (named after ``VLLM_DIST_IDENT``) and its groups' message queues'."""
    from vllm.distributed import parallel_state

    patterns = []
    ident = os.environ.get("VLLM_DIST_IDENT")
    if ident:
        patterns.append(glob.escape(ident) + "-*-cpushm*")
    for name in ("_WORLD", "_TP", "_PP"):
        queue = getattr(getattr(parallel_state, name, None), "mq_broadcaster", None)
        memory = getattr(getattr(queue, "buffer", None), "shared_memory", None)
        if memory is not None:
            patterns.append(glob.escape(memory.name))
    return patterns


def _chain(future: Future[list[Any]]) -> Future[Any]:
    """A future of the one reply in ``future``'s list."""
    target: Future[Any] = Future()
    target.set_running_or_notify_cancel()

    def done(source: Future[list[Any]]) -> None:
        error = source.exception()
        if error is not None:
            target.set_exception(error)
        else:
            target.set_result(source.result()[0])

    future.add_done_callback(done)
    return target


class SdkExecutor(Executor):
    """vLLM's engine drives its workers through an Executor SDK backend.

    Pass it as ``distributed_executor_backend`` (the class, or ``"executor_vllm.SdkExecutor"``
    on the command line); choose the backend in ``additional_config["executor_sdk"]`` or the
    environment (see :func:`executor_vllm.read_settings`). Each rank runs vLLM's own worker in
    a :class:`~executor_vllm.VllmWorker`; every call reaches every rank in one order (the SDK
    core's rule), and a step's reply comes from the output rank alone.
    """

    supports_pp: bool = True

    def _init_executor(self) -> None:
        self._sdk: Any = None
        self._failure_callback: Callable[[], None] | None = None
        parallel = self.parallel_config
        refused = [
            (name, value)
            for name, value in (
                ("prefill_context_parallel_size", parallel.prefill_context_parallel_size),
                ("nnodes", getattr(parallel, "nnodes", 1)),
            )
            if value != 1
        ]
        if self.vllm_config.kv_transfer_config is not None:
            refused.append(("kv_transfer_config", "set"))
        if refused:
            raise ValueError(
                f"executor-vllm runs tensor and pipeline parallelism only; {refused} are not "
                "supported: leave them unset, or use vLLM's own mp executor"
            )
        settings = read_settings(self.vllm_config.additional_config, parallel.world_size)
        env = {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_ENV)}
        # vLLM's workers bind IPC sockets in VLLM_RPC_BASE_PATH and leave their files
        # behind: a directory of this executor's own, removed at shutdown.
        self._rpc_dir = env["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="executor-vllm-")
        self._shm_patterns: list[str] = []
        config = ExecutorConfig(
            backend=settings.backend,
            worker_cls="executor_vllm._worker:VllmWorker",
            worker_kwargs={"vllm_config": self.vllm_config, "driver_pid": os.getpid()},
            tensor_parallel_size=parallel.tensor_parallel_size,
            pipeline_parallel_size=parallel.pipeline_parallel_size,
            device=current_platform.device_type,
            async_scheduling=bool(self.scheduler_config.async_scheduling),
            rpc_timeout=settings.rpc_timeout,
            backend_options=settings.backend_options,
            env=env,
        )
        try:
            self._sdk = create_executor(config)
            if config.world_size > 1:
                # The ranks' shared-memory segments, to remove those a killed rank leaves in
                # /dev/shm (on the engine's node; vLLM's own mp leaves them).
                found = self._sdk.collective_rpc(_shm_patterns, timeout=60)
                self._shm_patterns = sorted({pattern for names in found for pattern in names})
        except BaseException:
            self.shutdown()  # what started, and the socket directory
            shutil.rmtree(self._rpc_dir, ignore_errors=True)
            raise
        self._sdk.register_failure_callback(self._failed)
        self.output_rank = config.output_rank
        # One rank that the backend runs in this process (uni, threads): a step is a direct
        # call, as on vLLM's own uni, not a handoff to the backend's thread and back.
        self._inline = config.world_size == 1 and self._sdk.transport.inline_runner() is not None
        _log.info(
            "vLLM runs on the Executor SDK's %r backend (%d rank(s); settings from %s)",
            self._sdk.backend_name,
            config.world_size,
            settings.source,
        )

    @property
    def sdk_executor(self) -> Any:
        """The SDK's :class:`executor_core.Executor` that runs the workers."""
        return self._sdk

    def _failed(self, error: ExecutorFailedError) -> None:
        _log.error("the Executor SDK failed: %s", error)
        callback, self._failure_callback = self._failure_callback, None
        if callback is not None:
            callback()

    def register_failure_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once when the workers fail for good (at once if they have): the
        engine then stops; the SDK's error, naming the ranks, is logged and raised by every
        later call."""
        if self._sdk.is_failed:
            callback()
        else:
            self._failure_callback = callback

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Run ``method`` (a vLLM worker method's name, or a callable taking vLLM's worker)
        on every rank; return the list of replies in rank order (or a Future of it). With
        ``unique_reply_rank``, only that rank's reply, not in a list."""
        if not isinstance(method, str):
            method = functools.partial(_on_vllm_worker, method)
        out = self._sdk.collective_rpc(
            method,
            timeout,
            args,
            kwargs,
            non_block=non_block,
            unique_reply_rank=unique_reply_rank,
        )
        if unique_reply_rank is None:
            return out
        return _chain(out) if non_block else out[0]

    def _step(self, method: str, arg: Any, non_block: bool) -> Any:
        if self._inline:
            if not non_block:
                return self._sdk.collective_rpc(method, args=(arg,))[0]
            done: Future[Any] = Future()
            try:
                done.set_result(self._sdk.collective_rpc(method, args=(arg,))[0])
            except Exception as exc:  # noqa: BLE001 - the engine gets it from the Future
                done.set_exception(exc)
            return done
        return self.collective_rpc(
            method,
            vllm_envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS,
            (arg,),
            non_block=non_block,
            unique_reply_rank=self.output_rank,
        )

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        """One step on every rank; the output rank's ``ModelRunnerOutput`` (or a Future)."""
        return self._step("execute_model", scheduler_output, non_block)

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        """The step's sampling on every rank; the output rank's output (or a Future)."""
        return self._step("sample_tokens", grammar_output, non_block)

    def execute_dummy_batch(self) -> None:
        """A dummy step on every rank (vLLM's data-parallel idle ranks)."""
        self.collective_rpc(
            "execute_dummy_batch",
            vllm_envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS,
            unique_reply_rank=self.output_rank,
        )

    def take_draft_token_ids(self) -> Any:
        """The speculative draft tokens of the output rank."""
        return self.collective_rpc(
            "take_draft_token_ids",
            vllm_envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS,
            unique_reply_rank=self.output_rank,
        )

    def check_health(self) -> None:
        """Raise unless every rank answers its health check within 10 seconds."""
        self._sdk.collective_rpc("check_health", timeout=10)

    def shutdown(self) -> None:
        """Stop every worker and release what the backend holds. Idempotent."""
        sdk = getattr(self, "_sdk", None)
        if sdk is None:
            return
        sdk.shutdown()
        shutil.rmtree(self._rpc_dir, ignore_errors=True)
        for pattern in self._shm_patterns:
            for path in glob.glob(os.path.join("/dev/shm", pattern)):
                with contextlib.suppress(OSError):
                    os.unlink(path)

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        """Async scheduling works: a step's Future completes when its reply arrives."""
        return True
