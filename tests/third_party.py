"""A third party's environment: a fresh virtual environment with only the core's and the
example backend's wheels, shared by the tests that look at the distributions from outside
(the ``third_party_venv`` fixture of the root conftest.py builds it once a session)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "executor-threads"


@attrs.frozen
class ThirdPartyVenv:
    """A fresh virtual environment that holds nothing of this repository but the wheels
    installed into it: the core's (with its ``testing`` extra) and the example backend's."""

    #: The environment's folder (``bin/python``, ``bin/executor``).
    path: Path
    #: The wheels it was installed from.
    core_wheel: Path
    example_wheel: Path

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


def run_checked(*args: str | Path, cwd: Path, timeout: float = 600) -> str:
    """Run ``args``; fail with the end of its output unless it exits 0; its stdout."""
    result = subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    output = f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert result.returncode == 0, f"{args} failed:\n{output}"
    return result.stdout


def make_third_party_venv(where: Path) -> ThirdPartyVenv:
    """Build the core's and the example backend's wheels, and an environment under ``where``
    with both installed (the core with its ``testing`` extra, for the example's tests)."""
    wheels = where / "wheels"
    pip = (sys.executable, "-m", "pip", "--disable-pip-version-check", "-q")
    run_checked(*pip, "wheel", "--no-deps", "-w", wheels, ROOT / "core", EXAMPLE, cwd=where)
    [core_wheel] = wheels.glob("executor_core-*.whl")
    [example_wheel] = wheels.glob("executor_threads-*.whl")
    venv = where / "venv"
    run_checked(sys.executable, "-m", "venv", venv, cwd=where)
    run_checked(
        venv / "bin" / "python", "-m", "pip", "install", "--disable-pip-version-check", "-q",
        "-c", ROOT / "constraints.txt", f"{core_wheel}[testing]", example_wheel,
        cwd=where,
    )  # fmt: skip
    return ThirdPartyVenv(venv, core_wheel, example_wheel)
