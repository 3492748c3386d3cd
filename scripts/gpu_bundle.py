#!/usr/bin/env python3
"""Build the offline bundle that scripts/gpu_check.py runs from on a lent GPU machine.

The lent machine reaches no package registry. Its image has Python 3.12 and a CUDA build of
torch, with the packages in :data:`IMAGE_PACKAGES`; everything else the checks import must
travel with the working tree, in one ignored folder (``gpu-bundle/``) carried along. This
script fills that folder with:

* the wheels of the project's distributions the checks use (:data:`DISTRIBUTIONS`: pure
  Python, built here with ``pip wheel``);
* the binary wheels, for the lent machine's Python and platform (CPython 3.12, manylinux
  x86_64 by default), of every requirement of those that the image lacks (pyzmq and
  cryptography, with its cffi and pycparser, for the mp backend's channel), pinned to the
  versions in constraints.txt. Ray is left out: it is too
  large to carry, and the Ray check says SKIP without it.

It checks the folder's size, writes ``bundle.json`` (what is in it and for which Python), and
prints the one command to run on the lent machine (:func:`device_command`; docs/gpu.md has
it too). Usage::

    .venv/bin/python scripts/gpu_bundle.py                 # builds gpu-bundle/
    .venv/bin/python scripts/gpu_bundle.py --print-command # the device command only

``--python-version`` and ``--platform`` build for another interpreter: the test suite
rehearses the lent machine's steps with a bundle for this machine's Python
(tests/test_gpu_bundle.py). Building needs a package index (``pip wheel`` fetches the build
backend, hatchling, unless it is installed; ``pip download`` fetches the binary wheels).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Sequence
from email.parser import HeaderParser
from pathlib import Path
from typing import Any

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent

#: The project's distributions that scripts/gpu_check.py imports (the SDK, the uni and mp
#: backends, the channel mp needs, the reference model), as folders of this repository.
DISTRIBUTIONS = ("core", "plugins/uniproc", "channel", "plugins/multiproc", "reference")

#: What the lent machine's image has besides the standard library and pip (its own notes say
#: so): these never travel in the bundle. torch there is 2.11.0+cu130.
IMAGE_PACKAGES = frozenset(
    {
        "torch",
        "attrs",
        "pluggy",
        "cloudpickle",
        "packaging",
        "psutil",
        "numpy",
        "safetensors",
        "tqdm",
        "pytest",
    }
)

#: Requirements that are not carried, and why (only the Ray backend needs Ray, and that
#: backend is not in :data:`DISTRIBUTIONS`).
LEFT_OUT = {"ray": "too large to carry (hundreds of MiB); the Ray check says SKIP without it"}

#: The lent machine's Python and platforms: its torch is a manylinux_2_28 build, so its glibc
#: takes manylinux_2_28 (and older) wheels.
DEFAULT_PYTHON_VERSION = "3.12"
DEFAULT_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux2014_x86_64")
DEFAULT_OUT = ROOT / "gpu-bundle"
#: The most the bundle may weigh: the device tool carries 64 MiB in all, the working tree
#: included, per command.
MAX_BUNDLE_BYTES = 32 << 20
#: What the checks may take on the lent machine (gpu_check.py's --budget, a hard bound):
#: with the install before it, the command ends within 7 minutes.
CHECK_BUDGET_S = 400
#: The device tool's timeout to give the command: past the 7 minutes, so that
#: gpu_check.py's own budget ends the run and its report comes back.
DEVICE_TIMEOUT_S = 480
MANIFEST = "bundle.json"


class BundleError(Exception):
    """Building the bundle failed; the message says why and what to do."""


def device_command(
    *,
    python: str = "python3",
    bundle: str = "gpu-bundle",
    mode: str = "--require-gpu",
    budget_s: int = CHECK_BUDGET_S,
) -> str:
    """The bash command to run in the repository root of the lent machine (its output folder
    in ``$OUT``): install the bundle offline into a fresh folder, run every check with the
    image's own ``python`` and torch, keep the report, the printout and each check's log in
    ``$OUT``, and exit with gpu_check.py's status.

    The rehearsal in the test suite runs the same command with this machine's Python and
    ``mode="--dry-run"``.
    """
    return (
        "set -o pipefail; T=$(mktemp -d) && "
        f"{python} -m pip install -q --disable-pip-version-check --no-index --no-deps "
        f'--target "$T/site" {bundle}/*.whl && '
        f'PYTHONPATH="$T/site" {python} scripts/gpu_check.py {mode} --budget {budget_s} '
        '--workdir "$T/work" --json "$OUT/gpu_check.json" | tee "$OUT/gpu_check.txt"; '
        's=$?; cp "$T"/work/*.log "$OUT"/ 2>/dev/null; rm -rf "$T"; exit $s'
    )


# --- requirements -----------------------------------------------------------------------------


def _machine(platforms: Sequence[str]) -> str:
    """The CPU architecture (``platform_machine``) the platform tags name."""
    machines = {
        m.group(1)
        for tag in platforms
        if (m := re.search(r"(x86_64|aarch64|ppc64le|s390x|i686|armv7l)$", tag))
    }
    if len(machines) != 1:
        raise BundleError(f"--platform tags {list(platforms)} must name one architecture")
    return machines.pop()


def target_environment(python_version: str, platforms: Sequence[str]) -> dict[str, str]:
    """The environment markers of CPython ``python_version`` on Linux with ``platforms``."""
    if not re.fullmatch(r"3\.\d+(\.\d+)?", python_version):
        raise BundleError(f"--python-version {python_version!r}: expected 3.X or 3.X.Y")
    short = ".".join(python_version.split(".")[:2])
    full = python_version if python_version.count(".") == 2 else f"{short}.0"
    return {
        "implementation_name": "cpython",
        "implementation_version": full,
        "os_name": "posix",
        "platform_machine": _machine(platforms),
        "platform_python_implementation": "CPython",
        "platform_release": "",
        "platform_system": "Linux",
        "platform_version": "",
        "python_full_version": full,
        "python_version": short,
        "sys_platform": "linux",
    }


def wheel_metadata(wheel: Path) -> tuple[str, str, list[Requirement]]:
    """A wheel's name, version and requirements (from its ``*.dist-info/METADATA``)."""
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if len(names) != 1:
            raise BundleError(f"{wheel.name}: expected one .dist-info/METADATA, found {names}")
        text = archive.read(names[0]).decode()
    headers = HeaderParser().parsestr(text)
    requires = [Requirement(line) for line in headers.get_all("Requires-Dist") or []]
    return str(headers["Name"]), str(headers["Version"]), requires


def _applies(requirement: Requirement, env: dict[str, str], extras: Iterable[str]) -> bool:
    if requirement.marker is None:
        return True
    marker: Marker = requirement.marker
    return any(marker.evaluate({**env, "extra": extra}) for extra in ("", *extras))


def missing_requirements(
    wheels: Sequence[Path], env: dict[str, str], roots: dict[str, set[str]]
) -> dict[str, Requirement]:
    """The requirements of ``wheels`` (with the extras in ``roots`` and those their own
    requirements ask for) that neither the wheels themselves nor the image provide, by
    canonical name. A requirement in :data:`LEFT_OUT` is an error: it would not be there."""
    metadata: dict[str, tuple[str, list[Requirement]]] = {
        canonicalize_name(n): (n, reqs) for n, _v, reqs in map(wheel_metadata, wheels)
    }
    wanted: dict[str, set[str]] = {name: set(extras) for name, extras in roots.items()}
    todo = list(wanted)
    missing: dict[str, Requirement] = {}
    while todo:
        name = todo.pop()
        for req in metadata[name][1] if name in metadata else ():
            if not _applies(req, env, wanted[name]):
                continue
            dep = canonicalize_name(req.name)
            if dep in LEFT_OUT:
                raise BundleError(
                    f"{metadata[name][0]} requires {req.name}, which the bundle leaves out: "
                    f"{LEFT_OUT[dep]}"
                )
            if dep in metadata:
                if dep not in wanted or not set(req.extras) <= wanted[dep]:
                    wanted.setdefault(dep, set()).update(req.extras)
                    todo.append(dep)
            elif dep not in IMAGE_PACKAGES:
                missing.setdefault(dep, req)
    return missing


def _constraints() -> dict[str, str]:
    """constraints.txt's pins, by canonical name."""
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[canonicalize_name(name)] = version.strip()
    return pins


def pinned(requirement: Requirement, pins: dict[str, str]) -> str:
    """``requirement`` as a pip argument, at the version constraints.txt pins (the one tested
    here) when that satisfies it, else as it is."""
    pin = pins.get(canonicalize_name(requirement.name))
    if pin is not None and requirement.specifier.contains(pin, prereleases=True):
        return f"{requirement.name}=={pin}"
    return f"{requirement.name}{requirement.specifier}"


# --- building ---------------------------------------------------------------------------------


def _pip(*args: str | Path) -> None:
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", *map(str, args)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        output = (done.stdout + done.stderr).strip().splitlines()[-25:]
        raise BundleError(
            f"pip {args[0]} failed (exit status {done.returncode}); building the bundle needs "
            "a package index (PyPI) and, for pip download, wheels for the target:\n  "
            + "\n  ".join(output)
        )


def _prepare(out: Path) -> None:
    """Make ``out`` an empty folder; refuse one that holds anything but an earlier bundle."""
    if out.exists():
        if not out.is_dir():
            raise BundleError(f"{out} exists and is not a folder")
        entries = list(out.iterdir())
        if entries and not (out / MANIFEST).is_file():
            raise BundleError(
                f"{out} is not empty and holds no {MANIFEST}: not a bundle folder this script "
                "made; choose another --out"
            )
        shutil.rmtree(out)
    out.mkdir(parents=True)


def build(out: Path, python_version: str, platforms: Sequence[str]) -> dict[str, Any]:
    """Fill ``out`` with the bundle; return its manifest (also written to ``bundle.json``)."""
    env = target_environment(python_version, platforms)
    _prepare(out)
    # The build backend from this environment where it is installed, else pip fetches it.
    isolation = ("--no-build-isolation",) if importlib.util.find_spec("hatchling") else ()
    _pip("wheel", "-q", "--no-deps", *isolation, "-w", out, *(ROOT / d for d in DISTRIBUTIONS))
    project = sorted(out.glob("*.whl"))
    impure = [w.name for w in project if not w.name.endswith("-py3-none-any.whl")]
    if impure or len(project) != len(DISTRIBUTIONS):
        raise BundleError(f"expected {len(DISTRIBUTIONS)} pure-Python wheels, got {project}")
    roots: dict[str, set[str]] = {canonicalize_name(wheel_metadata(w)[0]): set() for w in project}
    pins = _constraints()
    third_party: list[Path] = []
    missing: dict[str, Requirement] = missing_requirements(project, env, roots)
    while missing:
        before = set(out.glob("*.whl"))
        tags = [arg for p in platforms for arg in ("--platform", p)]
        specs = [pinned(req, pins) for req in missing.values()]
        _pip(
            "download", "-q", "--only-binary=:all:", "--no-deps", "--implementation", "cp",
            "--python-version", python_version, *tags, "-d", out, *specs,
        )  # fmt: skip
        new = sorted(set(out.glob("*.whl")) - before)
        if not new:
            raise BundleError(f"pip download brought no new wheel for {specs}")
        third_party += new
        roots.update({name: set(missing[name].extras) for name in missing})
        missing = missing_requirements([*project, *third_party], env, roots)
    wheels = [*project, *third_party]
    total = sum(w.stat().st_size for w in wheels)
    if total > MAX_BUNDLE_BYTES:
        raise BundleError(
            f"the bundle weighs {total / (1 << 20):.1f} MiB, more than the "
            f"{MAX_BUNDLE_BYTES >> 20} MiB it may (the device tool carries 64 MiB in all)"
        )
    manifest: dict[str, Any] = {
        "python_version": python_version,
        "platforms": list(platforms),
        "image_packages": sorted(IMAGE_PACKAGES),
        "left_out": LEFT_OUT,
        "wheels": [
            {
                "file": w.name,
                "name": wheel_metadata(w)[0],
                "version": wheel_metadata(w)[1],
                "bytes": w.stat().st_size,
                "kind": "project" if w in project else "third-party",
            }
            for w in wheels
        ],
        "total_bytes": total,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _relative(out: Path) -> str:
    """``out`` as the device command names it: from the repository root when inside it."""
    try:
        return str(out.resolve().relative_to(ROOT))
    except ValueError:
        return str(out.resolve())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Build the offline bundle scripts/gpu_check.py runs from on a lent GPU "
        "machine, and print the command to run there."
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="default: gpu-bundle/")
    parser.add_argument(
        "--python-version",
        default=DEFAULT_PYTHON_VERSION,
        help=f"the target's Python, for its binary wheels (default {DEFAULT_PYTHON_VERSION})",
    )
    parser.add_argument(
        "--platform",
        action="append",
        help=f"a platform tag of the target's wheels, repeatable (default {DEFAULT_PLATFORMS})",
    )
    parser.add_argument(
        "--print-command", action="store_true", help="print the device command and exit"
    )
    args = parser.parse_args(argv)
    bundle = _relative(args.out)
    command = device_command(bundle=bundle)
    if args.print_command:
        print(command)
        return 0
    platforms = tuple(args.platform or DEFAULT_PLATFORMS)
    try:
        manifest = build(args.out, args.python_version, platforms)
    except BundleError as exc:
        print(f"gpu_bundle: {exc}", file=sys.stderr)
        return 1
    wheels, total = manifest["wheels"], manifest["total_bytes"]
    print(
        f"gpu_bundle: {len(wheels)} wheels, {total / (1 << 20):.2f} MiB in {bundle}/ "
        f"(CPython {args.python_version}, {', '.join(platforms)})"
    )
    for wheel in wheels:
        print(f"  {wheel['file']:<72} {wheel['bytes'] / 1024:8.1f} KiB  {wheel['kind']}")
    print(f"  left out: {', '.join(f'{n} ({why})' for n, why in LEFT_OUT.items())}")
    print(f"  the image must have: {', '.join(sorted(IMAGE_PACKAGES))}")
    print(
        f'device command (run tool: carry=["{bundle}"], timeout_s={DEVICE_TIMEOUT_S}; '
        "the report comes back as gpu_check.json):"
    )
    print(command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
