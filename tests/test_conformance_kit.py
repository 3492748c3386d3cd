"""The conformance kit fails every broken backend, in seconds, naming the rule it broke.

Each backend in ``broken_backends.BROKEN`` is the example ``threads`` backend with one defect.
The kit runs against it in a fresh pytest process (stopping at the first failure), as a
third-party author would run it; the failure must name the broken rule, and the kit must
reach it within 10 s (a hang counts as a failure through the kit's own time limit).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from broken_backends import BROKEN, BROKEN_HANGS, BROKEN_RECOVERY

HERE = Path(__file__).parent
#: Slow: each case runs the kit in a pytest subprocess: seconds each.
pytestmark = pytest.mark.slow

_TEST_MODULE = """
from broken_backends import BROKEN
from executor_core.testing import ExecutorConformanceTests


class TestBroken(ExecutorConformanceTests):
    backend = BROKEN[{name!r}][0]
    world_size = 2
    time_limit_s = 8.0
    settle_s = 3.0
    slow_call_s = 0.5
"""

#: A process backend's recovery, alone (its kit area), as its author would run it.
_RECOVERY_MODULE = """
from broken_backends import BROKEN_RECOVERY
from executor_core.testing import RecoveryTests


class TestBrokenRecovery(RecoveryTests):
    backend = BROKEN_RECOVERY[{name!r}][0]
    world_size = 2
    workers_are_processes = True
    time_limit_s = 8.0
    settle_s = 3.0
    recovery_s = 6.0
"""

#: A process backend's hang bound, alone (its kit area).
_HANGS_MODULE = """
from broken_backends import BROKEN_HANGS
from executor_core.testing import HangTests


class TestBrokenHangs(HangTests):
    backend = BROKEN_HANGS[{name!r}][0]
    world_size = 2
    workers_are_processes = True
    time_limit_s = 12.0
    settle_s = 3.0
"""


def _run_kit(name: str, tmp_path: Path, module: str = _TEST_MODULE) -> tuple[str, float]:
    (tmp_path / "test_broken_kit.py").write_text(module.format(name=name))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-x",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, f"the kit passed a broken backend ({name}):\n{output[-3000:]}"
    took = re.search(r" in ([0-9.]+)s", output)
    assert took is not None, output[-2000:]
    return output, float(took.group(1))


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_kit_fails_the_broken_backend(name: str, tmp_path: Path) -> None:
    output, seconds = _run_kit(name, tmp_path)
    expected = BROKEN[name][1]
    assert expected in output, (
        f"the kit's failure does not name the rule {expected!r}:\n{output[-4000:]}"
    )
    assert seconds < 10, f"the kit took {seconds:.1f} s to fail {name}"


@pytest.mark.parametrize("name", sorted(BROKEN_RECOVERY))
def test_recovery_tests_fail_the_broken_backend(name: str, tmp_path: Path) -> None:
    output, seconds = _run_kit(name, tmp_path, _RECOVERY_MODULE)
    expected = BROKEN_RECOVERY[name][1]
    assert expected in output, (
        f"the kit's failure does not name the rule {expected!r}:\n{output[-4000:]}"
    )
    assert seconds < 10, f"the kit took {seconds:.1f} s to fail {name}"


@pytest.mark.parametrize("name", sorted(BROKEN_HANGS))
def test_hang_tests_fail_the_broken_backend(name: str, tmp_path: Path) -> None:
    output, seconds = _run_kit(name, tmp_path, _HANGS_MODULE)
    expected = BROKEN_HANGS[name][1]
    assert expected in output, (
        f"the kit's failure does not name the rule {expected!r}:\n{output[-4000:]}"
    )
    assert seconds < 20, f"the kit took {seconds:.1f} s to fail {name}"


def test_recovery_tests_pass_the_correct_process_backend(tmp_path: Path) -> None:
    """The kit passes a correct process backend that replaces ranks (its group restart is
    checked too, with replacement off); the correct backends that only restart are the
    cluster example and ``slurm``, whose kits run in their own tests."""
    (tmp_path / "test_processes_kit.py").write_text(
        "from broken_backends import _ReplacingProcessExecutor\n"
        "from executor_core.testing import HangTests, RecoveryTests\n\n\n"
        "class TestProcesses(RecoveryTests, HangTests):\n"
        "    backend = _ReplacingProcessExecutor\n    workers_are_processes = True\n"
        "    recovery_kills = 5\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:]
    assert " passed" in result.stdout


def test_kit_passes_the_correct_backend(tmp_path: Path) -> None:
    (tmp_path / "test_threads_kit.py").write_text(
        "from executor_core.testing import ExecutorConformanceTests\n\n\n"
        "class TestThreads(ExecutorConformanceTests):\n"
        "    backend = 'threads'\n    time_limit_s = 8.0\n"
        "    settle_s = 3.0\n    slow_call_s = 0.5\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-4000:]
