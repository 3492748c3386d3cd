"""A plugin whose hook implementation does not match the spec (pluggy rejects it)."""

from executor_core import hookimpl


@hookimpl
def executor_select_backend(config: object, available: object, unexpected_argument: object) -> None:
    """Asks for an argument the spec does not provide."""
