"""A plugin whose registration hook raises."""

from executor_core import hookimpl
from executor_core.backend import BackendSpec


@hookimpl
def executor_register_backends() -> list[BackendSpec]:
    raise RuntimeError("fixture plugin fails while declaring its backends")
