"""The slurm backend's options and declarations, without a Slurm cluster."""

from __future__ import annotations

from typing import Any

import pytest

from executor_core import ConfigError, ExecutorConfig, ExecutorError, create_executor
from executor_core.backend import default_registry
from executor_plugin_slurm import SlurmOptions
from executor_plugin_slurm._allocation import Where
from executor_plugin_slurm._executor import _runs_ranks


def _options(**values: Any) -> SlurmOptions:
    return SlurmOptions.from_backend_options(values, "slurm")


def test_the_backend_is_declared_with_what_it_needs() -> None:
    spec = default_registry().get("slurm")
    assert spec.distribution == "executor-plugin-slurm"
    assert "srun" in spec.description
    assert "salloc" in spec.description
    assert spec.capabilities.multi_node
    assert spec.capabilities.recovery == "replace"


def test_salloc_gets_the_options_slurm_users_know() -> None:
    options = _options(
        partition="gpu",
        account="proj7",
        time="1:30:00",
        gpus_per_node="a100:4",
        nodelist="n[1-2]",
        salloc_args=["--qos=high"],
    )
    assert options.salloc_argv(2) == [
        "--nodes=2",
        "--ntasks-per-node=1",
        "--partition=gpu",
        "--account=proj7",
        "--time=1:30:00",
        "--gpus-per-node=a100:4",
        "--nodelist=n[1-2]",
        "--qos=high",
    ]
    assert _options(time=30, gpus_per_node=8).salloc_argv(3)[2:] == [
        "--time=30",
        "--gpus-per-node=8",
    ]
    assert _options(slot_bytes=1 << 20).slot_bytes == 1 << 20  # mp's keys too


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("time", "ninety", "Slurm time limit"),
        ("time", 0, "minutes"),
        ("gpus_per_node", 0, "GPU count"),
        ("gpus_per_node", "a100:0", "type:count"),
        ("partition", "two words", "without spaces"),
        ("account", "", "non-empty"),
        ("salloc_args", "--qos=high", "list of strings"),
        ("srun_args", [""], "non-empty strings"),
        ("pending_timeout_s", 0, "> 0"),
        ("driver_runs_ranks", "yes", "True or False"),
    ],
)
def test_a_bad_option_is_refused_naming_it(key: str, value: Any, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as info:
        _options(**{key: value})
    assert key in str(info.value)


def test_an_unknown_key_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"known keys: .*'partition'.*'time'"):
        _options(nodes=2)


def test_the_driver_runs_node_0s_ranks_only_on_an_allocated_node() -> None:
    login = Where("7", ("n1", "n2"), None)
    on_node = Where("7", ("n1", "n2"), "n1")
    assert not _runs_ranks(_options(), login)
    assert _runs_ranks(_options(), on_node)
    assert not _runs_ranks(_options(driver_runs_ranks=False), on_node)
    assert _runs_ranks(_options(driver_runs_ranks=True), on_node)
    with pytest.raises(ConfigError, match="SLURMD_NODENAME"):
        _runs_ranks(_options(driver_runs_ranks=True), login)


def test_without_slurm_the_start_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SLURM_JOB_ID", "SLURM_JOBID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    config = ExecutorConfig(
        backend="slurm",
        worker_cls="executor_core.testing:ConformanceWorker",
        tensor_parallel_size=2,
        num_nodes=2,
    )
    with pytest.raises(ExecutorError, match="needs Slurm's 'salloc' on PATH"):
        create_executor(config)
