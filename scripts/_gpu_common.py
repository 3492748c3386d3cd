"""What every check of scripts/gpu_check.py shares: the outcome it returns, the context it runs
in, the time limits of its calls, and the reference worker's executor config.

Imported by the check modules from scripts/ (gpu_check.py's own directory, first on the path).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from executor_core import ExecutorConfig
    from executor_reference import ModelConfig

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"

#: Seconds a single collective call may take inside a check (a hang fails the call, not the run).
CALL_TIMEOUT_S = 60.0
#: Seconds torch.distributed may wait in a rendezvous or collective (NCCL / gloo).
DISTRIBUTED_TIMEOUT_S = 60.0
#: Seconds the mp and Ray backends may take to start their workers.
STARTUP_TIMEOUT_S = 60.0
#: Why the Ray check says SKIP where Ray is missing, as on a machine set up from the offline
#: bundle (scripts/gpu_bundle.py), which does not carry Ray.
NO_RAY = "Ray is not installed (the offline GPU bundle leaves it out: too large to carry)"


@dataclasses.dataclass
class Outcome:
    """What one check found: a status, a one-line summary with the figures, and the figures."""

    status: str
    summary: str
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Context:
    """Where a check runs: on the GPU, or on the CPU in the dry run; and its scratch folder."""

    gpu: bool
    workdir: Path

    @property
    def device(self) -> str:
        return "cuda" if self.gpu else "cpu"


def judge(summary: str, problems: list[str], figures: dict[str, Any]) -> Outcome:
    """PASS with ``summary`` when nothing is wrong, else FAIL with the problems after it."""
    if problems:
        return Outcome(FAIL, f"{summary} -- {'; '.join(problems)}", figures)
    return Outcome(PASS, summary, figures)


def describe(exc: BaseException) -> str:
    """An exception in one line: its type and the first line of its message."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"


def mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def cuda_count() -> int:
    import torch

    return int(torch.cuda.device_count())


def reference_model(size: str, seed: int = 0) -> ModelConfig:
    import attrs

    from executor_reference import MODEL_SIZES

    return attrs.evolve(MODEL_SIZES[size], seed=seed)


def reference_config(
    ctx: Context,
    model: ModelConfig,
    *,
    backend: str,
    device: str | None = None,
    tp: int = 1,
    kv_slots: int = 16,
    rpc_timeout: float | None = None,
) -> ExecutorConfig:
    """The main job's config (scripts/run.sh -> executor run) for the reference worker on
    ``device`` (default: the check's), with ``model``'s checkpoint in the check's folder."""
    from executor_core import ExecutorConfig
    from executor_reference import ensure_checkpoint

    return ExecutorConfig(
        backend=backend,
        worker_cls="executor_reference:ReferenceWorker",
        worker_kwargs={
            "checkpoint": str(ensure_checkpoint(model, ctx.workdir)),
            "kv_slots": kv_slots,
            "seed": model.seed,
            "cpu_threads": 1,
            "distributed_timeout_s": DISTRIBUTED_TIMEOUT_S,
        },
        tensor_parallel_size=tp,
        device=device or ctx.device,
        rpc_timeout=rpc_timeout,
        backend_options={"startup_timeout": STARTUP_TIMEOUT_S} if backend in ("mp", "ray") else {},
    )
