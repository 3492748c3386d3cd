"""The lent GPU machine's steps, rehearsed here short of the GPU.

scripts/gpu_bundle.py builds the offline bundle; the device command it prints installs it
with ``pip install --no-index --no-deps --target`` into an empty folder and runs
``scripts/gpu_check.py`` from there, with a Python that has an image's packages only
(``gpu_bundle.IMAGE_PACKAGES``: torch and the rest) and none of this repository's editable
installs, nor pyzmq or Ray: whatever the checks import beyond the image must come from the
bundle, or the run fails.

What differs from the lent machine:

* Python 3.11 and torch 2.13.0+cpu (this machine's) instead of 3.12 and 2.11.0+cu130: the
  bundle is built for this Python (``--python-version 3.11``), so its one binary wheel,
  pyzmq, is the cp311 build of the release the lent machine gets as cp312 (abi3). The
  project's own wheels are the same files. tests/test_torch_versions.py hides torch 2.11's
  missing APIs instead.
* The "image" is a virtual environment of this machine's Python whose site-packages links,
  from .venv, the image's packages, what they require, and pip: the same names, not the
  image's files.
* ``--dry-run`` instead of ``--require-gpu``: there is no GPU, so the CUDA-only checks say
  SKIP. This is the suite's one whole dry run (tests/test_gpu_check_script.py runs only the
  Ray check, in this repository's environment).
* Building needs a package index (pip fetches hatchling to build the wheels, and pyzmq);
  the lent machine needs none.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from test_gpu_check_script import RUN_ON_CPU, assert_full_dry_run

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_bundle.py"


def _load_bundle_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_bundle", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_bundle = _load_bundle_script()


def _image_distributions(names: set[str]) -> set[str]:
    """``names`` and every distribution they require, as installed here (no extras)."""
    found: set[str] = set()
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found:
            continue
        found.add(name)
        for line in metadata.distribution(name).requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return found


def _make_image(where: Path) -> Path:
    """A Python whose site-packages holds (as links into .venv's) the image's packages and
    nothing else; returns its interpreter."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    [site] = where.glob("lib/python*/site-packages")
    for name in sorted(_image_distributions({*gpu_bundle.IMAGE_PACKAGES, "pip"})):
        dist = metadata.distribution(name)
        tops = {Path(f).parts[0] for f in dist.files or () if not str(f).startswith("..")}
        for top in tops - {"__pycache__"}:
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not (site / top).exists():
                (site / top).symlink_to(source)
    return where / "bin" / "python"


def _clean_env(**extra: str) -> dict[str, str]:
    drop = {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "PYTHONNOUSERSITE": "1", **extra}


def _python(python: Path, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), "-c", code],
        capture_output=True,
        text=True,
        env=_clean_env(),
        cwd=python.parent,  # not the repository: nothing of it on the path
        check=False,
        timeout=120,
    )


def test_the_documented_device_command_is_the_one_the_script_prints() -> None:
    command = gpu_bundle.device_command()
    printed = subprocess.run(
        [sys.executable, str(SCRIPT), "--print-command"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    assert printed == command
    assert len(command) <= 2000  # what the device tool takes
    for doc in ("docs/gpu.md", "README.md"):
        assert command in (ROOT / doc).read_text(), f"{doc} lost the device command"
    assert "--no-index --no-deps" in command
    assert "--require-gpu" in command


def _wheel(where: Path, name: str, *requires: str) -> Path:
    """A wheel that holds only the metadata of a distribution requiring ``requires``."""
    path = where / f"{name.replace('-', '_')}-1.0-py3-none-any.whl"
    lines = [f"Name: {name}", "Version: 1.0", *(f"Requires-Dist: {r}" for r in requires)]
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name.replace('-', '_')}-1.0.dist-info/METADATA", "\n".join(lines))
    return path


def test_what_the_bundle_must_carry(tmp_path: Path) -> None:
    """Requirements the image has stay out, those of the bundle's own wheels are followed
    with their extras, markers are read for the target's Python, and Ray is refused."""
    wheels = [
        _wheel(tmp_path, "sdk-core", "attrs>=23", 'psutil; extra == "torch"', 'gone; extra == "x"'),
        _wheel(
            tmp_path,
            "sdk-model",
            "sdk-core[torch]",
            "torch>=2.4",
            "pyzmq>=25",
            'tomli>=1; python_version < "3.12"',
            'cffi; implementation_name == "pypy"',
        ),
    ]
    roots: dict[str, set[str]] = {"sdk-core": set(), "sdk-model": set()}
    platforms = gpu_bundle.DEFAULT_PLATFORMS
    on_312 = gpu_bundle.missing_requirements(
        wheels, gpu_bundle.target_environment("3.12", platforms), roots
    )
    assert sorted(on_312) == ["pyzmq"]
    on_311 = gpu_bundle.missing_requirements(
        wheels, gpu_bundle.target_environment("3.11", platforms), roots
    )
    assert sorted(on_311) == ["pyzmq", "tomli"]
    assert gpu_bundle.pinned(on_312["pyzmq"], {"pyzmq": "27.3.0"}) == "pyzmq==27.3.0"
    assert gpu_bundle.pinned(on_312["pyzmq"], {"pyzmq": "24.0"}) == "pyzmq>=25"
    with_ray = [*wheels, _wheel(tmp_path, "sdk-ray", "ray>=2.40")]
    with pytest.raises(gpu_bundle.BundleError, match=r"ray.*too large"):
        gpu_bundle.missing_requirements(
            with_ray,
            gpu_bundle.target_environment("3.12", platforms),
            {**roots, "sdk-ray": set()},
        )


def test_the_bundle_folder_is_ignored_by_git() -> None:
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "gpu-bundle/x.whl"], cwd=ROOT, check=False, timeout=60
    )
    assert ignored.returncode == 0, "gpu-bundle/ is not in .gitignore"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpu_check_runs_from_the_offline_bundle(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    built = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(bundle), "--python-version", version],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    manifest: dict[str, Any] = json.loads((bundle / "bundle.json").read_text())
    names = {canonicalize_name(w["name"]) for w in manifest["wheels"]}
    assert names == {
        "executor-core",
        "executor-plugin-uniproc",
        "executor-channel",
        "executor-plugin-multiproc",
        "executor-reference",
        "pyzmq",
        "cryptography",
        "cffi",
        "pycparser",
    }
    assert manifest["total_bytes"] == sum(w.stat().st_size for w in bundle.glob("*.whl"))
    assert manifest["total_bytes"] < 8 << 20  # well under the 64 MiB the device tool carries
    assert gpu_bundle.device_command(bundle=str(bundle.resolve())) in built.stdout
    image = _make_image(tmp_path / "image")
    command = gpu_bundle.device_command(python=str(image), bundle=str(bundle), mode="--dry-run")

    # The image has torch but not the SDK, nor what only the bundle brings.
    probe = _python(image, "import torch, attrs, pluggy, safetensors, tqdm, numpy, psutil")
    assert probe.returncode == 0, probe.stderr
    for module in ("executor_core", "executor_plugin_multiproc", "zmq", "ray"):
        missing = _python(image, f"import {module}")
        assert missing.returncode != 0, f"{module} is importable without the bundle"

    out, scratch = tmp_path / "out", tmp_path / "tmp"
    out.mkdir()
    scratch.mkdir()
    run = subprocess.run(
        ["bash", "-c", command],
        cwd=ROOT,  # where the device tool runs it: the repository root of a copy
        env=_clean_env(OUT=str(out), TMPDIR=str(scratch)),
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    output = f"{run.stdout}\n{run.stderr[-3000:]}"
    assert run.returncode == 0, output
    report: dict[str, Any] = json.loads((out / "gpu_check.json").read_text())
    assert report["complete"], output
    assert report["exit_status"] == 0, output
    assert report["mode"] == "dry-run"
    environment = report["environment"]
    # The SDK came from the folder the bundle was installed into, not from this repository.
    assert Path(environment["executor_core_path"]).is_relative_to(scratch), environment
    assert set(environment["backends"]) >= {"uni", "mp"}
    assert not environment["ray_installed"]
    # The suite's one whole dry run: every check listed, each that needs no GPU run here.
    rows = assert_full_dry_run(run.stdout, report)
    ray = rows["device_per_thread_ray"]
    assert ray["status"] == "SKIP", ray
    assert "offline GPU bundle" in ray["summary"], ray
    # The printout and each check's log came back in $OUT; the scratch folder is gone.
    assert (out / "gpu_check.txt").read_text() == run.stdout
    assert {f"{name}.log" for name in RUN_ON_CPU} <= {p.name for p in out.iterdir()}
    assert list(scratch.iterdir()) == []
