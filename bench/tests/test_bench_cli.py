"""The ``executor bench`` command line: it is listed, it is cheap to add, bad values are
refused before anything runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from bench_helpers import run_executor

import executor_bench


def test_executor_help_lists_bench() -> None:
    result = run_executor("--help")
    assert result.returncode == 0, result.stderr
    assert "bench" in result.stdout.split("{", 1)[1].split("}", 1)[0].split(",")


def test_bench_help_names_every_option() -> None:
    result = run_executor("bench", "--help")
    assert result.returncode == 0, result.stderr
    for option in (
        "--backends",
        "--baselines",
        "--sizes",
        "--kinds",
        "--workloads",
        "--repeats",
        "--workers",
        "--quick",
        "--output-dir",
        "--vllm-path",
    ):
        assert option in result.stdout


def test_adding_the_command_imports_nothing_heavy() -> None:
    """``executor`` starts with every plugin's commands: this one's costs no benchmark code."""
    probe = (
        "import json, sys\n"
        "from executor_core._cli import build_parser\n"
        "from executor_core.backend import default_registry\n"
        "build_parser(default_registry())\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    loaded = set(json.loads(out.stdout.splitlines()[-1]))
    assert "executor_bench._cli" in loaded  # the command was added...
    heavy = {"torch", "ray", "matplotlib", "tqdm", "executor_bench._run"}
    assert not {m for m in loaded if m in heavy or m.split(".")[0] in heavy}


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--sizes", "4X", "accepted: comma-separated sizes"),
        ("--sizes", "6", "not a positive multiple of 4 bytes"),
        (
            "--baselines",
            "pipe,mpi",
            "'mpi': accepted are pipe, ray, vllm, vllm-own, vllm-16m, zmq",
        ),
        ("--kinds", "float", "'float': accepted are bytes, tensor"),
        (
            "--workloads",
            "warm",
            "'warm': accepted are imports, overhead, hot, cold, payload, startup",
        ),
        ("--repeats", "0", "'0' is not a positive integer"),
        ("--workers", "two", "'two' is not a positive integer"),
        ("--idle-ms", "-1", "'-1' is not a positive number"),
        ("--backends", "uni,nosuch", "no installed backend is called 'nosuch'; installed: "),
    ],
)
def test_a_bad_value_is_refused_naming_the_option(
    option: str, value: str, says: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    result = run_executor("bench", option, value, "--output-dir", str(out), timeout=60)
    assert result.returncode == 2
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith(f"executor bench: error: argument {option}"), error
    assert says in error
    assert not out.exists()  # refused before anything ran or was written


def test_an_output_dir_that_cannot_be_made_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = run_executor(
        "bench", "--backends", "uni", "--output-dir", str(blocker / "out"), timeout=60
    )
    assert result.returncode == 2
    assert "executor bench: error: argument --output-dir: cannot create" in result.stderr


def test_version_is_the_distributions() -> None:
    from importlib.metadata import version

    assert version("executor-bench") == executor_bench.__version__
