"""Importing the core and the plugin modules stays cheap: no torch, Ray or zmq."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "ray", "zmq", "numpy")


def _modules_after(code: str) -> set[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_import_executor_core_loads_nothing_heavy() -> None:
    loaded = _modules_after("import executor_core")
    assert not {m for m in loaded if m.split(".")[0] in (*HEAVY, "attr", "pluggy")}


def test_public_api_and_registry_load_no_backend_code() -> None:
    loaded = _modules_after(
        "from executor_core import Executor, ExecutorConfig\n"
        "from executor_core.backend import default_registry\n"
        "default_registry().backends()"
    )
    assert not {m for m in loaded if m.split(".")[0] in HEAVY}
    # Plugin modules were imported (to declare backends), their executors were not.
    assert "executor_plugin_uniproc" in loaded
    assert "executor_plugin_uniproc._executor" not in loaded
    assert not {
        m for m in loaded if m.startswith(("executor_plugin_multiproc.", "executor_plugin_ray."))
    }


@pytest.mark.parametrize("name", ["backends", "--version"])
def test_cli_listing_imports_nothing_heavy(name: str) -> None:
    loaded = _modules_after(
        "import sys\nfrom executor_core._cli import main\nmain([" + repr(name) + "])"
    )
    assert not {m for m in loaded if m.split(".")[0] in HEAVY}


@pytest.mark.parametrize("package", ["executor_plugin_multiproc", "executor_plugin_ray"])
def test_plugin_user_names_import_from_the_package_on_first_use(package: str) -> None:
    module = importlib.import_module(package)
    assert set(module._LAZY) <= set(module.__all__)
    for name, where in module._LAZY.items():
        assert getattr(module, name) is getattr(importlib.import_module(where, package), name)
