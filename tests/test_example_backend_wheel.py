"""A third party's view: the core's and the example backend's wheels, in a fresh venv.

Builds both wheels, installs them (with the kit's ``testing`` extra) into a new virtual
environment that holds nothing of this repository (tests/third_party.py; the environment is
shared with tests/test_reference_plugin.py), lists the backends there and runs the example's
own test suite, the conformance kit, against it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from third_party import EXAMPLE, ThirdPartyVenv, run_checked

#: Slow: builds a wheel and a fresh virtual environment (once a session: ``third_party_venv``).
pytestmark = pytest.mark.slow


@pytest.mark.slow
def test_example_backend_installs_and_passes_the_kit_in_a_fresh_venv(
    tmp_path: Path, third_party_venv: ThirdPartyVenv
) -> None:
    venv = third_party_venv.path
    listing = run_checked(venv / "bin" / "executor", "backends", cwd=tmp_path)
    assert "threads" in listing.split()

    tests = tmp_path / "example-tests"
    shutil.copytree(EXAMPLE / "tests", tests)
    pytest_args = ("-m", "pytest", "-q", "-p", "no:cacheprovider", tests)
    output = run_checked(third_party_venv.python, *pytest_args, cwd=tmp_path)
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
