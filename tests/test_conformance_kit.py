"""The conformance kit fails every broken backend, in seconds, naming the rule it broke.

Each backend in ``broken_backends.BROKEN`` is the example ``threads`` backend with one defect;
those in ``BROKEN_PROCESSES``, ``BROKEN_RECOVERY`` and ``BROKEN_HANGS`` a small backend of
worker processes with one. The kit runs against each in a fresh pytest process (stopping at
the first failure), as a third-party author would run it, with no flag saying what the
backend is; the failure must name the broken rule, within the time given (a hang counts as a
failure through the kit's own time limit). The kit passes the correct backends, and what
other programs leave in /dev/shm meanwhile is none of its business.

The runs are started together, a few at a time (``_AT_ONCE``), when the module's first test
asks for them: they mostly wait (for settling, deadlines, probes), and one after another they
took about 165 s of CI's 25 minutes. Each test then checks its own run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from broken_backends import BROKEN, BROKEN_HANGS, BROKEN_PROCESSES, BROKEN_RECOVERY, LEAK_PREFIX

HERE = Path(__file__).parent
#: Slow: each case runs the kit in a pytest subprocess: seconds each.
pytestmark = pytest.mark.slow

_KIT_MODULE = """
from broken_backends import {table}
from executor_core.testing import {area}


class TestBroken({area}):
    backend = {table}[{name!r}][0]
    world_size = 2
    time_limit_s = {limit}
    settle_s = 3.0
    slow_call_s = 0.5
    recovery_s = 6.0
    recovery_kills = 3
    # The threads example waits 5 s for a rank hung in a call before it gives up on it.
    shutdown_s = 7.0
"""

#: The kit's area each table runs, its tests' time limit, and the seconds a run may take.
_TABLES = {
    "BROKEN": ("ExecutorConformanceTests", 8.0, 10),
    "BROKEN_PROCESSES": ("LifecycleTests", 8.0, 30),
    "BROKEN_RECOVERY": ("RecoveryTests", 8.0, 10),
    "BROKEN_HANGS": ("HangTests", 12.0, 20),
}
#: Defects that take longer to show: a shutdown waited for ``shutdown_s``, or recoveries in a
#: row after the other recovery tests.
_SLOWER = {"unbounded_shutdown": 30, "leaks_per_restart": 30}


@pytest.fixture(scope="module", autouse=True)
def _no_leaked_segments() -> Iterator[None]:
    """Remove the /dev/shm segments the leaking backends made (the kit must have seen them)."""
    yield
    for name in os.listdir("/dev/shm"):
        if name.startswith(LEAK_PREFIX):
            os.unlink(f"/dev/shm/{name}")


def _pytest(tmp_path: Path, module: str, timeout: float = 180) -> tuple[int, str, float]:
    (tmp_path / "test_kit.py").write_text(module)
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
        timeout=timeout,
    )
    output = result.stdout + result.stderr
    took = re.search(r" in ([0-9.]+)s", output)
    assert took is not None, output[-2000:]
    return result.returncode, output, float(took.group(1))


_CASES: dict[str, dict[str, tuple[type, str]]] = {
    "BROKEN": dict(BROKEN),
    "BROKEN_PROCESSES": dict(BROKEN_PROCESSES),
    "BROKEN_RECOVERY": dict(BROKEN_RECOVERY),
    "BROKEN_HANGS": dict(BROKEN_HANGS),
}


_CASE_KEYS = [(table, name) for table, cases in _CASES.items() for name in sorted(cases)]

_PROCESSES_MODULE = (
    "from broken_backends import _ReplacingProcessExecutor\n"
    "from executor_core.testing import HangTests, LifecycleTests, RecoveryTests\n\n\n"
    "class TestProcesses(RecoveryTests, HangTests, LifecycleTests):\n"
    "    backend = _ReplacingProcessExecutor\n"
)
_THREADS_MODULE = (
    "from executor_core.testing import ExecutorConformanceTests\n\n\n"
    "class TestThreads(ExecutorConformanceTests):\n"
    "    backend = 'threads'\n    time_limit_s = 12.0\n"
    "    settle_s = 3.0\n    slow_call_s = 0.5\n    shutdown_s = 7.0\n"
)
#: How many kit runs go at once (on CI's 2 cores; each mostly waits).
_AT_ONCE = 3


def _beside_other_programs(tmp_path: Path) -> tuple[int, str, float]:
    """The ``threads`` kit while another program makes (and keeps) /dev/shm segments."""
    foreign = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import itertools, os, time\n"
            "for n in itertools.count():\n"
            f"    open('/dev/shm/{LEAK_PREFIX}foreign-{{}}'.format(n), 'w').close()\n"
            "    time.sleep(0.05)\n",
        ]
    )
    try:
        return _pytest(tmp_path, _THREADS_MODULE)
    finally:
        foreign.kill()
        foreign.wait()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[Any, Future[Any]]]:
    """Every kit run of this module, started at once (the longest first), by its key."""
    with ThreadPoolExecutor(_AT_ONCE, thread_name_prefix="kit-run") as pool:
        started: dict[Any, Future[Any]] = {
            "processes": pool.submit(
                _pytest, tmp_path_factory.mktemp("processes"), _PROCESSES_MODULE, 300
            ),
            "beside": pool.submit(_beside_other_programs, tmp_path_factory.mktemp("beside")),
        }
        for table, name in _CASE_KEYS:
            area, limit, _ = _TABLES[table]
            module = _KIT_MODULE.format(table=table, area=area, name=name, limit=limit)
            started[table, name] = pool.submit(_pytest, tmp_path_factory.mktemp(name), module)
        try:
            yield started
        finally:
            for future in started.values():
                future.cancel()


@pytest.mark.parametrize(("table", "name"), _CASE_KEYS)
def test_kit_fails_the_broken_backend(table: str, name: str, runs: dict[Any, Future[Any]]) -> None:
    code, output, took = runs[table, name].result()
    assert code == 1, f"the kit passed a broken backend ({name}):\n{output[-3000:]}"
    expected = _CASES[table][name][1]
    assert expected in output, f"the failure does not name the rule {expected!r}:\n{output[-4000:]}"
    seconds = _SLOWER.get(name, _TABLES[table][2])
    assert took < seconds, f"the kit took {took:.1f} s to fail {name} (at most {seconds} s)"


def test_kit_passes_the_correct_process_backend(runs: dict[Any, Future[Any]]) -> None:
    """The kit passes a correct backend of worker processes that replaces ranks (its group
    restart is checked too, with replacement off), with no flag saying what it is; the
    correct backend that only restarts is the cluster example."""
    code, output, _ = runs["processes"].result()
    assert code == 0, output[-4000:]


def test_kit_passes_the_correct_backend_beside_other_programs(
    runs: dict[Any, Future[Any]],
) -> None:
    """The kit passes the ``threads`` example while another program makes (and keeps) new
    /dev/shm segments all along: the leftover checks look at what the executor made."""
    code, output, _ = runs["beside"].result()
    assert code == 0, output[-4000:]
