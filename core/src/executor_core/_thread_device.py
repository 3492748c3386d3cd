"""The worker's accelerator device, made current on every thread that runs its methods.

CUDA (and torch's other accelerators) keep the current device per thread. A worker sets it
once, in ``init_device``, on the thread that built it; but backends run calls on other
threads: a runner thread for calls with a timeout, a socket-serving thread, a compiled
graph's loop, the caller's own thread. On such a thread the current device would be device 0,
another rank's GPU, so ``"cuda"``, ``.cuda()``, streams, events and NCCL's object collectives
would land there. The wrapper captures the device current at the end of the worker's set-up
and makes it current on each new thread before that thread's first call.

Nothing here imports torch: a worker that never imported it, or never initialised an
accelerator, has nothing to carry over.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["ThreadDevice", "capture_thread_device"]


def _current_device_setter() -> Callable[[], Any] | None:
    """A call that makes this thread's current accelerator device current on another
    thread, or None when this process has not initialised one."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    cuda = torch.cuda
    if cuda.is_initialized():
        setter: Callable[[], Any] = functools.partial(cuda.set_device, cuda.current_device())
        return setter
    # Other accelerators (XPU, out-of-tree ones such as NPUs) through torch.accelerator, on
    # torch versions that have it; asking for the type does not initialise the device.
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None:
        return None
    device = accelerator.current_accelerator()
    if device is None or device.type == "cuda":
        return None
    module = torch.get_device_module(device.type)
    is_initialized = getattr(module, "is_initialized", None)
    if is_initialized is None or not is_initialized():
        return None
    other: Callable[[], Any] = functools.partial(module.set_device, module.current_device())
    return other


class ThreadDevice:
    """Makes one device current on each thread, once per thread.

    The thread that creates it already has the device current. :meth:`bind` costs one
    thread-local lookup once a thread is bound.
    """

    __slots__ = ("_local", "_set_device")

    def __init__(self, set_device: Callable[[], Any]) -> None:
        self._set_device = set_device
        self._local = threading.local()
        self._local.bound = True

    def bind(self) -> None:
        """Make the device current on the calling thread, if it is not yet."""
        local = self._local
        if not getattr(local, "bound", False):
            self._set_device()
            local.bound = True


def capture_thread_device() -> ThreadDevice | None:
    """The calling thread's current accelerator device, to make current on other threads
    (None when no accelerator was initialised in this process)."""
    setter = _current_device_setter()
    return None if setter is None else ThreadDevice(setter)
