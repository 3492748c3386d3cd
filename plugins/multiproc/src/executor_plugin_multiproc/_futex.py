"""Futex wait/wake on a 32-bit word in shared memory, through ``syscall(2)`` via ctypes.

A futex is the cheapest real blocking wake-up between processes that share memory: the
kernel compares the word with the expected value atomically before sleeping, so a wake-up
that races with going to sleep is never lost. Where the syscall is not available (not Linux,
or an architecture whose number we do not know) :func:`wait` falls back to a short sleep.
"""

from __future__ import annotations

import ctypes
import platform
import sys
import time
from typing import Any

__all__ = ["HAVE_FUTEX", "wait", "wake"]

# Numbers of the futex syscall; generic-syscall architectures share 98.
_SYS_FUTEX = {
    "x86_64": 202,
    "amd64": 202,
    "aarch64": 98,
    "arm64": 98,
    "riscv64": 98,
    "loongarch64": 98,
    "ppc64le": 221,
    "ppc64": 221,
    "s390x": 238,
}
# Not the _PRIVATE variants: waiters and wakers live in different processes.
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_WAKE_ALL = 0x7FFFFFFF
#: Fallback sleep while polling when futexes are unavailable.
_POLL_S = 0.0005


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_syscall() -> tuple[Any, int]:
    number = _SYS_FUTEX.get(platform.machine().lower())
    if not sys.platform.startswith("linux") or number is None:
        return None, 0
    libc = ctypes.CDLL(None, use_errno=True)
    func = libc.syscall
    func.restype = ctypes.c_long
    func.argtypes = [
        ctypes.c_long,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_uint32,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_uint32,
    ]
    return func, number


_syscall, _NR_FUTEX = _load_syscall()

#: True when waits block in the kernel; False when they poll (see module docstring).
HAVE_FUTEX = _syscall is not None


def wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep while the 32-bit word at ``address`` equals ``expected``, at most ``timeout_s``.

    May return early (a wake-up, a signal, or the word already differing): callers re-check
    their condition in a loop.
    """
    if _syscall is None:
        time.sleep(min(timeout_s, _POLL_S))
        return
    timeout_s = max(timeout_s, 0.0)
    seconds = int(timeout_s)
    spec = _Timespec(seconds, int((timeout_s - seconds) * 1e9))
    # The result is ignored on purpose: EAGAIN (value changed), ETIMEDOUT and EINTR all mean
    # "go and look again", which every caller does.
    _syscall(_NR_FUTEX, address, _FUTEX_WAIT, expected & 0xFFFFFFFF, ctypes.byref(spec), None, 0)


def wake(address: int) -> None:
    """Wake every process sleeping in :func:`wait` on ``address``."""
    if _syscall is not None:
        _syscall(_NR_FUTEX, address, _FUTEX_WAKE, _WAKE_ALL, None, None, 0)
