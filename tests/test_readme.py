"""The README's usage example runs as written and prints what its comments say."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_example_runs(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"## Use an executor\n\n```python\n(.*?)```", readme, re.DOTALL)
    assert match, "README.md lost its 'Use an executor' example"
    script = tmp_path / "example.py"
    script.write_text(match.group(1))
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[0, 1]", "[10, 20, 30]"]
