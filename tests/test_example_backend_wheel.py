"""A third party's view: the core's and the example backend's wheels, in a fresh venv.

Builds both wheels, installs them (with the kit's ``testing`` extra) into a new virtual
environment that holds nothing of this repository, lists the backends there and runs the
example's own test suite, the conformance kit, against it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

#: Slow: builds a wheel and a fresh virtual environment.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "executor-threads"


def _run(*args: str | Path, cwd: Path, timeout: float = 600) -> str:
    result = subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    output = f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert result.returncode == 0, f"{args} failed:\n{output}"
    return result.stdout


@pytest.mark.slow
def test_example_backend_installs_and_passes_the_kit_in_a_fresh_venv(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    pip = (sys.executable, "-m", "pip", "--disable-pip-version-check", "-q")
    _run(*pip, "wheel", "--no-deps", "-w", wheels, ROOT / "core", EXAMPLE, cwd=tmp_path)
    [core_wheel] = wheels.glob("executor_core-*.whl")
    [example_wheel] = wheels.glob("executor_threads-*.whl")

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    _run(
        python, "-m", "pip", "install", "--disable-pip-version-check", "-q",
        "-c", ROOT / "constraints.txt", f"{core_wheel}[testing]", example_wheel,
        cwd=tmp_path,
    )  # fmt: skip
    listing = _run(venv / "bin" / "executor", "backends", cwd=tmp_path)
    assert "threads" in listing.split()

    tests = tmp_path / "example-tests"
    shutil.copytree(EXAMPLE / "tests", tests)
    output = _run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", tests, cwd=tmp_path)
    assert " passed" in output
    assert "failed" not in output


def test_example_backend_is_at_most_80_lines_of_code() -> None:
    lines = [
        line
        for path in (EXAMPLE / "src").rglob("*.py")
        for line in path.read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    assert len(lines) <= 80, f"the example backend grew to {len(lines)} lines of code"
