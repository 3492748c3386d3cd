"""The core is contracts only: the reference model and ``executor run`` live in
executor-reference, whose plugin adds the command; the core's wheel holds no model code and,
without executor-reference, says where ``run`` comes from."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from third_party import ThirdPartyVenv

import executor_reference
from executor_core import _cli
from executor_core.backend import Registry, default_registry

ROOT = Path(__file__).resolve().parents[1]
EXECUTOR_CLI = str(Path(sys.executable).with_name("executor"))

#: What model code imports; the core's torch helpers import none of it.
MODEL_IMPORTS = ("torch.nn", "safetensors")


def _imports(source: str) -> Iterator[str]:
    """Every module ``source`` imports, ``from torch import nn`` counted as ``torch.nn``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def _model_code(name: str, source: str) -> list[str]:
    """Why the module file ``name`` (a path inside the package) is model code, if it is."""
    found = [f"{name} is the moved {part}" for part in ("reference", "_main_job") if part in name]
    found.extend(
        f"{name} imports {module}"
        for module in _imports(source)
        if any(module == m or module.startswith(f"{m}.") for m in MODEL_IMPORTS)
    )
    if "nn.Module" in source:
        found.append(f"{name} defines a torch module")
    return found


def test_the_core_sources_hold_no_model_code() -> None:
    package = ROOT / "core" / "src" / "executor_core"
    found = [
        problem
        for path in sorted(package.rglob("*.py"))
        for problem in _model_code(str(path.relative_to(package)), path.read_text())
    ]
    assert found == []


def test_run_comes_from_the_executor_reference_plugin() -> None:
    registry = default_registry()
    assert registry.plugins["reference"] == ("executor-reference", executor_reference.__version__)
    args = _cli.build_parser(registry).parse_args(["run", "--model-size", "tiny"])
    assert args.func.__module__ == "executor_reference._main_job"
    assert (args.model_size, args.backend) == ("tiny", "auto")
    # The core's own parser has no `run`: only the plugin adds it.
    with pytest.raises(SystemExit):
        _cli.build_parser(Registry()).parse_args(["run"])


def test_the_packages_names_load_on_first_use() -> None:
    # The registry imports executor_reference in every process: its names wait until used.
    assert set(executor_reference._LAZY) == set(executor_reference.__all__) - {
        "__version__",
        "executor_register_commands",
    }
    for name, where in executor_reference._LAZY.items():
        module = importlib.import_module(where, "executor_reference")
        assert getattr(executor_reference, name) is getattr(module, name)


def test_executor_help_lists_run() -> None:
    done = subprocess.run(
        [EXECUTOR_CLI, "--help"], capture_output=True, text=True, timeout=60, check=True
    )
    assert "run the main job: the reference model on a backend" in done.stdout
    assert "pip install executor-reference" not in done.stdout


def test_run_without_its_plugin_loaded_says_so() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "executor_core", "run", "--tp", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "EXECUTOR_PLUGINS": "uniproc"},
    )
    assert done.returncode == 2
    version = importlib.metadata.version("executor-reference")
    assert "executor: error: unknown command 'run'." in done.stderr
    assert f"provided by executor-reference, installed ({version}) but its plugin" in done.stderr
    assert "EXECUTOR_PLUGINS='uniproc' restricts loading." in done.stderr


def _run(*args: str | Path, cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=600, check=False
    )
    if check:
        assert done.returncode == 0, f"{args} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done


@pytest.mark.slow  # builds wheels and a fresh virtual environment (once a session)
def test_the_core_wheel_holds_no_model_code_and_asks_for_executor_reference(
    tmp_path: Path, third_party_venv: ThirdPartyVenv
) -> None:
    wheel = third_party_venv.core_wheel
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        found = [
            problem
            for name in names
            if name.endswith(".py")
            for problem in _model_code(name, archive.read(name).decode())
        ]
        [metadata] = [n for n in names if n.endswith(".dist-info/METADATA")]
        requires = [
            line.split(":", 1)[1].strip()
            for line in archive.read(metadata).decode().splitlines()
            if line.startswith("Requires-Dist:")
        ]
    assert "executor_core/torch/_distributed.py" in names  # the torch helpers stay
    assert found == []
    # The [torch] extra is what executor_core.torch needs, nothing of the model's.
    assert not [r for r in requires if r.startswith(("safetensors", "tqdm", "numpy"))], requires

    # A third party with the core (and another plugin, the example backend) but without
    # executor-reference: no `run`, and the error says what to install.
    venv = third_party_venv.path
    done = _run(venv / "bin" / "executor", "run", "--tp", "2", cwd=tmp_path, check=False)
    assert done.returncode == 2
    assert "unknown command 'run'." in done.stderr
    assert "provided by executor-reference: pip install executor-reference" in done.stderr
    helped = _run(venv / "bin" / "executor", "--help", cwd=tmp_path).stdout
    assert "  run: pip install executor-reference" in helped
