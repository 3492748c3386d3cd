"""The contract for backend authors: everything a backend (in-tree or third-party) uses.

A backend is an :class:`~executor_core.Executor` subclass that names a :class:`Transport`:
:meth:`Transport.start` starts the workers (with :meth:`TransportHost.contexts` and
:meth:`TransportHost.wrapper`) and waits until each is ready; :meth:`Transport.send` carries
a :class:`Call` to every rank, where the worker's :meth:`WorkerWrapper.handle` runs it;
replies come back to :attr:`TransportHost.deliver`; :meth:`TransportHost.worker_died`
reports a worker that is gone; :meth:`Transport.close` stops the workers. The core implements
every rule of a call around these. A plugin module declares the backend with
:func:`hookimpl` on ``executor_register_backends`` returning a :class:`BackendSpec`;
``executor_core.testing`` is the conformance kit, ``executor_core.options`` parses
``backend_options``. See docs/writing-a-backend.md.
"""

from __future__ import annotations

from ._calls import Call
from ._errors import RemoteFailure
from ._hooks import hookimpl
from ._net import find_free_port, reserve_port, tcp_init_method
from ._registry import (
    PLUGINS_ENV_VAR,
    BackendSpec,
    BrokenPlugin,
    Capabilities,
    PluginRegistrationError,
    Registry,
    default_registry,
    lazy_getattr,
)
from ._transport import Transport, TransportHost
from ._worker import WorkerContext
from ._wrapper import WorkerWrapper, method_name, preload_worker

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
