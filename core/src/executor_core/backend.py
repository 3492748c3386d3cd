"""The contract for backend authors: everything a backend (in-tree or third-party) uses.

A backend is an :class:`~executor_core.Executor` subclass that names a :class:`Transport`:

- :meth:`Transport.start` starts the workers (with :meth:`TransportHost.contexts` and
  :meth:`TransportHost.wrapper`) and waits until each is ready;
- :meth:`Transport.send` carries a :class:`Call` to every rank, where the worker's
  :meth:`WorkerWrapper.handle` runs it; replies come back to :attr:`TransportHost.deliver`
  (from the transport's threads, or from :meth:`Transport.poll` when ``polls = True``);
- :meth:`TransportHost.worker_died` reports a worker that is gone;
- :meth:`Transport.close` stops the workers.

The core implements every rule of a call around these primitives (validation, ordering,
timeouts, reply gathering, failure, shutdown, cleanup). A plugin module declares the backend
with :func:`hookimpl` on ``executor_register_backends`` returning a :class:`BackendSpec`;
``executor_core.testing`` is the conformance kit that checks the result, and
``executor_core.options`` parses ``backend_options``. See
docs/writing-a-backend.md.
"""

from __future__ import annotations

from ._calls import Call
from ._hookspecs import hookimpl
from ._host import TransportHost
from ._lazy import lazy_getattr
from ._net import find_free_port, reserve_port, tcp_init_method
from ._qualname import preload_worker
from ._registry import (
    PLUGINS_ENV_VAR,
    BackendSpec,
    BrokenPlugin,
    Capabilities,
    PluginRegistrationError,
    Registry,
    default_registry,
)
from ._transport import Transport
from ._wire import RemoteFailure, method_name
from ._worker import WorkerContext
from ._wrapper import WorkerWrapper

__all__ = [
    "PLUGINS_ENV_VAR",
    "BackendSpec",
    "BrokenPlugin",
    "Call",
    "Capabilities",
    "PluginRegistrationError",
    "Registry",
    "RemoteFailure",
    "Transport",
    "TransportHost",
    "WorkerContext",
    "WorkerWrapper",
    "default_registry",
    "find_free_port",
    "hookimpl",
    "lazy_getattr",
    "method_name",
    "preload_worker",
    "reserve_port",
    "tcp_init_method",
]
