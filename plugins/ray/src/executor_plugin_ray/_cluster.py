"""Which Ray: the connection this process already has, a cluster, or a new local instance.

Ray is one connection per process, shared by every executor in it. :func:`acquire_ray` hands
out leases; :meth:`RayLease.release` shuts Ray down only when the last lease this module took
is released, and only if this module connected or started it. A Ray session the user (or a
test fixture) initialised stays up.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import psutil  # type: ignore[import-untyped]  # psutil ships no type information
import ray

from ._options import RayOptions
from ._reaper import reap

__all__ = ["RayLease", "acquire_ray", "local_num_cpus"]

logger = logging.getLogger("executor_plugin_ray")

#: Seconds the reaper lets Ray's processes exit by themselves before it kills them.
_REAPER_GRACE_S = 3.0
_TOKEN_ENV = "RAY_AUTH_TOKEN"
_TOKEN_SOURCES = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
#: ray.init sets this in the process environment when it starts a token-auth instance.
_AUTH_MODE_ENV = "RAY_AUTH_MODE"
#: One token for every local instance this process starts (see :func:`_token_env`).
_process_token = secrets.token_hex(32)


class _State:
    """What this module owns of the process's Ray connection."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.leases = 0
        self.owned = False  # True if this module called ray.init (and must call ray.shutdown)
        self.started_local = False
        self.temp_dir: str | None = None
        self.remove_temp_dir = False
        self.reaper: subprocess.Popen[bytes] | None = None
        self.token_set = False


_state = _State()


class RayLease:
    """One executor's use of the process's Ray connection. Release it exactly once."""

    def __init__(self, *, owned: bool, started_local: bool) -> None:
        self.owned = owned
        self.started_local = started_local
        self._released = False
        self._lock = threading.Lock()

    def release(self) -> None:
        """Give the lease back; the last one shuts down what this module started."""
        with self._lock:
            if self._released:
                return
            self._released = True
        if self.owned:
            _release_owned()


def acquire_ray(options: RayOptions, *, world_size: int) -> RayLease:
    """Make sure this process is connected to Ray and return a lease on the connection: Ray
    already initialised in this process, as it is (one process holds one connection; an
    ``address`` then ignored is logged at INFO); else the ``address`` option; else
    ``$RAY_ADDRESS``; else a new local instance sized to the machine (and big enough for
    ``world_size`` workers)."""
    with _state.lock:
        if _state.owned and ray.is_initialized():
            _state.leases += 1
            return RayLease(owned=True, started_local=_state.started_local)
        if ray.is_initialized():
            if options.address is not None:
                logger.info(
                    "Ray is already initialised in this process; using it rather than "
                    "connecting to address=%r",
                    options.address,
                )
            return RayLease(owned=False, started_local=False)
        address = options.address or os.environ.get("RAY_ADDRESS") or None
        if address is not None:
            _connect(address, options)
        else:
            _start_local(options, world_size)
        _state.owned, _state.started_local, _state.leases = True, address is None, 1
        return RayLease(owned=True, started_local=_state.started_local)


def _connect(address: str, options: RayOptions) -> None:
    _reset_token_cache()  # load the token the environment or ~/.ray holds now
    try:
        ray.init(
            address=address, log_to_driver=options.log_to_driver, logging_level=logging.WARNING
        )
    except Exception as exc:
        raise ConnectionError(
            f"cannot connect to the Ray cluster at {address!r} "
            f"(from {'backend_options' if options.address else '$RAY_ADDRESS'}): {exc}. "
            "Check the address, and that this process has the cluster's auth token "
            "($RAY_AUTH_TOKEN or ~/.ray/auth_token) if the cluster uses token authentication."
        ) from exc


def local_num_cpus(options: RayOptions, world_size: int) -> float:
    """Logical CPUs of a local instance: the machine's, or enough for the workers if more."""
    if options.local_num_cpus is not None:
        return options.local_num_cpus
    machine = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(float(machine or 1), world_size * options.num_cpus_per_worker)


def _start_local(options: RayOptions, world_size: int) -> None:
    if options.temp_dir is not None:
        os.makedirs(options.temp_dir, exist_ok=True)
        temp_dir, remove = os.path.abspath(options.temp_dir), False
    else:
        temp_dir, remove = tempfile.mkdtemp(prefix="executor-ray-"), True
    before = {proc.pid for proc in psutil.Process().children()}
    gpus = options.local_num_gpus
    try:
        with _token_env(), _quiet_auth_notice():
            ray.init(
                num_cpus=math.ceil(local_num_cpus(options, world_size)),
                num_gpus=None if gpus is None else math.ceil(gpus),
                include_dashboard=False,
                log_to_driver=options.log_to_driver,
                logging_level=logging.WARNING,
                _temp_dir=temp_dir,
            )
    except BaseException:
        # A failed start can leave some of Ray's processes running: stop them here.
        with contextlib.suppress(Exception):
            ray.shutdown()
        reap(_new_processes(before), temp_dir if remove else None, grace_s=1.0)
        _restore_token_env()
        raise
    _state.temp_dir, _state.remove_temp_dir = temp_dir, remove
    _state.reaper = _start_reaper(before, temp_dir if remove else None)


@contextlib.contextmanager
def _token_env() -> Iterator[None]:
    """Give a new local instance a token without writing one into the home directory: Ray
    turns token authentication on for it and, without a token, writes ~/.ray/auth_token, a
    file that outlives the instance. With no auth mode chosen and no token, this process's
    random token goes through the environment instead (removed again at shutdown)."""
    if os.environ.get(_AUTH_MODE_ENV) is None and not _has_token():
        os.environ[_TOKEN_ENV] = _process_token
        _state.token_set = True
    _reset_token_cache()  # Ray caches the token it loaded last
    yield


def _has_token() -> bool:
    if any(os.environ.get(name) for name in _TOKEN_SOURCES):
        return True
    return os.path.exists(os.path.join(os.path.expanduser("~"), ".ray", "auth_token"))


def _restore_token_env() -> None:
    if _state.token_set:
        if os.environ.get(_TOKEN_ENV) == _process_token:
            del os.environ[_TOKEN_ENV]
        # Set by ray.init where it was unset; kept, it would make the next local instance
        # (here or in a child process) write ~/.ray/auth_token.
        os.environ.pop(_AUTH_MODE_ENV, None)
        _state.token_set = False
        _reset_token_cache()


def _reset_token_cache() -> None:
    # Looked up by name: older Rays have no token auth, and ray/_raylet.pyi does not declare it.
    loader = getattr(ray._raylet, "AuthenticationTokenLoader", None)
    if loader is not None:
        loader.instance().reset_cache()


class _DropAuthNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Token authentication is enabled" not in record.getMessage()


@contextlib.contextmanager
def _quiet_auth_notice() -> Iterator[None]:
    """Drop Ray's "token authentication is enabled" notice: it is this backend's documented
    default for a local instance, not news worth a warning on every start."""
    auth_logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    notice_filter = _DropAuthNotice()
    auth_logger.addFilter(notice_filter)
    try:
        yield
    finally:
        auth_logger.removeFilter(notice_filter)


def _new_processes(before: set[int]) -> list[tuple[int, float]]:
    """``(pid, create_time)`` of this process's children not in ``before``, and theirs."""
    pids: list[tuple[int, float]] = []
    for child in psutil.Process().children():
        if child.pid not in before:
            with contextlib.suppress(psutil.Error):
                procs = (child, *child.children(recursive=True))
                pids.extend((proc.pid, proc.create_time()) for proc in procs)
    return pids


def _start_reaper(before: set[int], temp_dir: str | None) -> subprocess.Popen[bytes] | None:
    """The watchdog of a local instance (``_reaper``), fed its processes; its own session,
    so that a Ctrl-C sent to the terminal's process group does not end it."""
    spec = {"pids": _new_processes(before), "temp_dir": temp_dir, "grace_s": _REAPER_GRACE_S}
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "executor_plugin_ray._reaper", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError:
        logger.warning("could not start the Ray reaper; a killed driver may leave Ray processes")
        return None


def _release_owned() -> None:
    with _state.lock:
        _state.leases -= 1
        if _state.leases > 0 or not _state.owned:
            return
        _state.owned = False
        reaper, _state.reaper = _state.reaper, None
        temp_dir, _state.temp_dir = _state.temp_dir, None
        started_local, _state.started_local = _state.started_local, False
        try:
            ray.shutdown()
        finally:
            if started_local:
                _restore_token_env()
            if reaper is not None:
                _stop_reaper(reaper)
            if _state.remove_temp_dir and temp_dir is not None:
                shutil.rmtree(temp_dir, ignore_errors=True)


def _stop_reaper(reaper: subprocess.Popen[bytes]) -> None:
    assert reaper.stdin is not None
    with contextlib.suppress(OSError):
        reaper.stdin.close()  # EOF: the reaper checks Ray's processes are gone, then exits
    deadline = time.monotonic() + 2 * _REAPER_GRACE_S + 5
    try:
        reaper.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait(5)
