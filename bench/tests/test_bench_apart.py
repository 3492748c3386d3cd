"""The workloads that only run when asked for, each with needs of its own (``recovery``,
``reference``, ``engine``, ``slurm``, ``otel``): accepted by ``--workloads``, out of the
default run, reported as skipped with the reason where a need is missing, and measured."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from bench_helpers import run_executor

from executor_bench._config import BenchConfig
from executor_bench._options import DEFAULT_WORKLOADS, WORKLOADS
from executor_bench._report import to_json
from executor_bench._run import Bench
from executor_core.backend import PLUGINS_ENV_VAR

#: Each workload, a module whose absence takes its need away, and what the reason then says.
NEEDS = {
    "recovery": ("executor_reference", "executor_reference not installed"),
    "reference": ("executor_reference", "executor_reference not installed"),
    "engine": ("vllm", "vllm not installed"),
    "otel": ("executor_plugin_otel", "executor_plugin_otel not installed"),
}


def _config(workload: str, backends: tuple[str, ...] = ("uni", "mp")) -> BenchConfig:
    return BenchConfig(
        backends=list(backends),
        baselines=[],
        sizes=[],
        kinds=None,
        workloads=[workload],
        repeats=None,
        workers=2,
        quick=True,
        idle_s=0.0,
        vllm_path=None,
        progress=False,
    )


@pytest.mark.parametrize("workload", [*NEEDS, "slurm"])
def test_asked_for_only(workload: str) -> None:
    assert workload in WORKLOADS
    assert workload not in DEFAULT_WORKLOADS


@pytest.mark.parametrize("workload", sorted(NEEDS))
def test_a_missing_need_skips_the_workload_with_the_reason(
    workload: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PLUGINS_ENV_VAR, "uniproc,multiproc")  # kept as set: no env change
    hidden, says = NEEDS[workload]
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == hidden else find_spec(name, *a),
    )
    result = Bench(_config(workload)).measure()
    document = to_json(result, {"date": "now"}, "executor bench")
    assert {"name": workload, "role": "workload", "reason": says} in document["skipped"]
    assert document["tables"] == []
    assert document["failed"] == []


def test_slurm_is_skipped_with_the_reason_when_not_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PLUGINS_ENV_VAR, "multiproc,slurm,cluster")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    bench = Bench(_config("slurm", ("slurm", "mp", "cluster")))
    assert bench.sides == []
    [entry] = [entry for entry in bench.skipped if entry.name == "slurm"]
    assert entry.role == "workload"
    assert "as root" in entry.reason


def test_slurm_needs_its_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PLUGINS_ENV_VAR, "uniproc,multiproc")
    bench = Bench(_config("slurm"))  # --backends uni,mp: no slurm, no cluster
    [entry] = [entry for entry in bench.skipped if entry.name == "slurm"]
    assert entry.reason == "needs the backends cluster, slurm (installed, in --backends)"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("executor_plugin_otel") is None, reason="no otel")
def test_the_otel_workload_writes_its_table(tmp_path: Path) -> None:
    """The cheapest of them, run for real, quick: its table is in results.json and .md."""
    out = tmp_path / "out"
    result = run_executor(
        "bench", "--workloads", "otel", "--quick", "--no-progress", "--output-dir", str(out)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    [table] = json.loads((out / "results.json").read_text())["tables"]
    assert table["workload"] == "otel"
    rows = {row[0]: row for row in table["rows"]}
    assert rows["no plugin"][2] == "+0.00"
    over = float(rows["otel: metrics only (EXECUTOR_OTEL_TRACES=0)"][2])
    assert over > 0  # the plugin does work on every call
    assert "## otel" in (out / "results.md").read_text()
