"""The adapter's settings and its checks of vLLM, without starting an engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from executor_vllm import (
    CONFIG_KEY,
    ENV_BACKEND,
    ENV_OPTIONS,
    Settings,
    SettingsError,
    check_vllm_version,
    read_settings,
)


def test_default_backend_is_uni_for_one_rank_else_mp() -> None:
    assert read_settings({}, 1, {}).backend == "uni"
    assert read_settings({}, 2, {}) == Settings(backend="mp")


def test_additional_config_comes_before_the_environment() -> None:
    env = {ENV_BACKEND: "ray", ENV_OPTIONS: '{"num_cpus_per_worker": 1}'}
    section = {"backend": "threads", "backend_options": {"x": 1}, "rpc_timeout": 30}
    settings = read_settings({CONFIG_KEY: section}, 2, env)
    assert (settings.backend, settings.backend_options, settings.rpc_timeout) == (
        "threads",
        {"x": 1},
        30.0,
    )
    from_env = read_settings({"other": 1}, 2, env)
    assert (from_env.backend, from_env.backend_options) == ("ray", {"num_cpus_per_worker": 1})
    assert ENV_BACKEND in from_env.source


@pytest.mark.parametrize(
    ("config", "env", "expected"),
    [
        ({}, {ENV_OPTIONS: "{not json"}, "not JSON"),
        ({}, {ENV_OPTIONS: "[1, 2]"}, "backend_options must be an object"),
        ({CONFIG_KEY: "mp"}, {}, "must be a dict"),
        ({CONFIG_KEY: {"backnd": "mp"}}, {}, r"unknown keys \['backnd'\]"),
        ({CONFIG_KEY: {"backend": 3}}, {}, "backend must be an SDK backend name"),
        ({CONFIG_KEY: {"backend": "mp", "rpc_timeout": -1}}, {}, "rpc_timeout"),
    ],
)
def test_malformed_settings_say_what_is_wrong(
    config: dict[str, object], env: dict[str, str], expected: str
) -> None:
    with pytest.raises(SettingsError, match=expected):
        read_settings(config, 2, env)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.3", "0.32.1.dev4"])
def test_vllm_in_range_is_taken(version: str) -> None:
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0", "not-a-version"])
def test_vllm_out_of_range_is_refused_with_the_fix(version: str) -> None:
    with pytest.raises(ImportError, match=r"runs on vLLM >=0.32,<0.33.*pip install"):
        check_vllm_version(version)


def _import_executor(tmp_path: Path, setup: str) -> subprocess.CompletedProcess[str]:
    code = f"{setup}\nimport executor_vllm\nexecutor_vllm.SdkExecutor\n"
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        check=False,
    )


def test_missing_vllm_is_a_clear_import_error(tmp_path: Path) -> None:
    proc = _import_executor(tmp_path, "import sys; sys.modules['vllm'] = None")
    assert proc.returncode == 1
    assert "ImportError: executor_vllm.SdkExecutor needs vLLM >=0.32,<0.33" in proc.stderr


def test_vllm_of_another_release_is_refused_at_import(tmp_path: Path) -> None:
    fake = tmp_path / "vllm"
    fake.mkdir()
    (fake / "__init__.py").write_text("__version__ = '0.31.0'\n")
    proc = _import_executor(tmp_path, f"import sys; sys.path.insert(0, {str(tmp_path)!r})")
    assert proc.returncode == 1
    assert "runs on vLLM >=0.32,<0.33, but vLLM 0.31.0 is installed" in proc.stderr
