"""A plugin whose registration hook raises."""

from executor_core import BackendSpec, hookimpl


@hookimpl
def executor_register_backends() -> list[BackendSpec]:
    raise RuntimeError("fixture plugin fails while declaring its backends")
