"""ExecutorConfig validation: every bad value names the field, the value and what is allowed."""

from __future__ import annotations

from typing import Any

import pytest

from executor_core import ConfigError, ExecutorConfig, WorkerBase


class _Worker(WorkerBase):
    pass


def test_defaults_and_derived_world_size() -> None:
    config = ExecutorConfig(worker_cls=_Worker, tensor_parallel_size=2, pipeline_parallel_size=3)
    assert config.world_size == 6
    assert config.backend == "auto"
    assert config.distributed_host == "127.0.0.1"
    assert config.output_rank == 4  # first TP rank of the last stage
    assert config.rank_of(pp_rank=1, tp_rank=1) == 3


def test_evolve_rederives_world_size() -> None:
    config = ExecutorConfig(worker_cls=_Worker, tensor_parallel_size=2)
    assert config.evolve(pipeline_parallel_size=2).world_size == 4
    assert config.evolve(rpc_timeout=3).rpc_timeout == 3


@pytest.mark.parametrize(
    ("overrides", "field", "hint"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size", ">= 1"),
        ({"pipeline_parallel_size": -1}, "pipeline_parallel_size", ">= 1"),
        ({"tensor_parallel_size": 2, "world_size": 3}, "world_size", "2 * 1 = 2"),
        ({"tensor_parallel_size": True}, "tensor_parallel_size", "integer"),
        ({"num_nodes": 0}, "num_nodes", ">= 1"),
        ({"rpc_timeout": 0}, "rpc_timeout", "> 0"),
        ({"rpc_timeout": "5"}, "rpc_timeout", "> 0"),
        ({"backend": ""}, "backend", "registered backend name"),
        ({"backend": 3}, "backend", "Executor subclass"),
        ({"backend": dict}, "backend", "Executor subclass"),
        ({"worker_cls": "no_colon"}, "worker_cls", "package.module:MyWorker"),
        ({"worker_cls": dict}, "worker_cls", "WorkerBase subclass"),
        ({"env": {"A": 1}}, "env", "strings"),
        ({"env": {"A=B": "x"}}, "env", "without '='"),
        ({"device": ""}, "device", "non-empty"),
    ],
)
def test_invalid_values_name_field_value_and_rule(
    overrides: dict[str, Any], field: str, hint: str
) -> None:
    kwargs: dict[str, Any] = {"worker_cls": _Worker, **overrides}
    with pytest.raises(ConfigError) as info:
        ExecutorConfig(**kwargs)
    assert info.value.field == field
    message = str(info.value)
    assert f"ExecutorConfig.{field}=" in message
    assert hint in message
    assert isinstance(info.value, ValueError)


def test_worker_cls_qualname_accepted_and_config_is_frozen() -> None:
    config = ExecutorConfig(worker_cls="executor_core.testing:ConformanceWorker", backend="uni")
    with pytest.raises(AttributeError):
        config.backend = "mp"  # type: ignore[misc]  # frozen: the assignment itself is the test


def test_mappings_are_copied() -> None:
    env = {"A": "1"}
    config = ExecutorConfig(worker_cls=_Worker, env=env)
    env["A"] = "2"
    assert config.env == {"A": "1"}
