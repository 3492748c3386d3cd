"""The changelog's fragments are named as towncrier expects, and every one of them renders."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FRAGMENTS = ROOT / "changelog.d"


def _types() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["towncrier"]
    return {entry["directory"] for entry in config["type"]}


def test_fragment_names_name_an_issue_and_a_type() -> None:
    types = _types()
    pattern = re.compile(r"^(\d+|\+[\w-]+)\.(?P<type>[a-z]+)(\.\d+)?\.md$")
    for path in FRAGMENTS.iterdir():
        if path.name == "README.md":
            continue
        match = pattern.match(path.name)
        assert match, f"{path.name}: name it <issue>.<type>.md or +<name>.<type>.md"
        assert match["type"] in types, f"{path.name}: the type is one of {sorted(types)}"
        assert path.read_text().strip(), f"{path.name} is empty"


def test_every_fragment_renders_into_the_draft() -> None:
    towncrier = Path(sys.executable).with_name("towncrier")
    draft = subprocess.run(
        [str(towncrier), "build", "--draft", "--version", "0.0.0-test"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    flat = " ".join(draft.split())
    for path in FRAGMENTS.glob("*.md"):
        if path.name == "README.md":
            continue
        first_words = " ".join(path.read_text().split()[:6])
        assert first_words in flat, f"{path.name} is missing from towncrier's draft"
