"""``ExecutorConfig.backend_options``, parsed one way for every backend (for backend authors).

A backend declares its options as a frozen attrs class whose fields carry a check in their
metadata (:func:`option`), and names it as its executor's ``options_cls``. The core's
:class:`~executor_core.Executor` checks ``ExecutorConfig.backend_options`` against that class
before anything starts: :func:`parse_backend_options` refuses unknown keys (listing the known
ones) and bad values with the same :class:`~executor_core.ConfigError` shape on every
backend. A backend that names no options class gets :class:`NoOptions`, and refuses every key.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs

from ._errors import ConfigError

__all__ = [
    "NoOptions",
    "boolean",
    "integer",
    "number",
    "one_of",
    "option",
    "optional",
    "parse_backend_options",
    "text",
]

T = TypeVar("T", bound=attrs.AttrsInstance)
#: Takes a value; returns it (converted) or raises ValueError("must be ...").
Check = Callable[[Any], Any]


def option(default: Any, check: Check) -> Any:
    """An attrs field for an options class: its default and the check that parses a value.

    A mutable default (a dict, list or set) is copied for each instance."""
    if isinstance(default, dict | list | set):
        mutable = default
        return attrs.field(factory=lambda: type(mutable)(mutable), metadata={"check": check})
    return attrs.field(default=default, metadata={"check": check})


@attrs.frozen
class NoOptions:
    """The options class of a backend that takes no ``backend_options`` (the default
    ``Executor.options_cls``): every key is refused."""


def parse_backend_options(cls: type[T], options: Mapping[str, Any], backend: str) -> T:
    """``cls(**options)``, each value checked; :class:`ConfigError` names a bad key or value
    (and, for an unknown key, every key the ``backend`` takes)."""
    fields = {field.name: field for field in attrs.fields(cls)}
    unknown = sorted(set(options) - set(fields), key=str)
    if unknown:
        bad = {key: options[key] for key in unknown}
        if not fields:
            raise ConfigError(
                "backend_options",
                bad,
                f"the {backend!r} backend takes no backend_options; leave them empty",
            )
        raise ConfigError(
            "backend_options",
            bad,
            f"unknown key(s) {unknown} for the {backend!r} backend; known keys: {sorted(fields)}",
        )
    values: dict[str, Any] = {}
    for key, value in options.items():
        check = fields[key].metadata.get("check")
        try:
            values[key] = check(value) if check is not None else value
        except (TypeError, ValueError) as exc:
            raise ConfigError("backend_options", {key: value}, f"{key!r} {exc}") from None
    return cls(**values)


def number(
    *, above: float | None = None, at_least: float | None = None, at_most: float | None = None
) -> Check:
    """A finite number (int or float, not bool) within the bounds given; returned as float."""

    def check(value: Any) -> float:
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        if not is_number or not math.isfinite(value):
            raise ValueError("must be a number")
        if above is not None and not value > above:
            raise ValueError(f"must be a number > {above:g}")
        if at_least is not None and not value >= at_least:
            raise ValueError(f"must be a number >= {at_least:g}")
        if at_most is not None and not value <= at_most:
            raise ValueError(f"must be a number <= {at_most:g}")
        return float(value)

    return check


def integer(*, at_least: int, at_most: int | None = None) -> Check:
    """An int (not bool) of at least ``at_least`` (and at most ``at_most``, if given)."""

    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < at_least:
            raise ValueError(f"must be an integer >= {at_least}")
        if at_most is not None and value > at_most:
            raise ValueError(f"must be an integer <= {at_most}")
        return value

    return check


def boolean() -> Check:
    """True or False."""

    def check(value: Any) -> bool:
        if not isinstance(value, bool):
            raise ValueError("must be True or False")
        return value

    return check


def text() -> Check:
    """A non-empty string."""

    def check(value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise ValueError("must be a non-empty string")
        return value

    return check


def one_of(*choices: str, upper: bool = False) -> Check:
    """One of ``choices`` (compared in upper case when ``upper``)."""

    def check(value: Any) -> str:
        candidate = value.upper() if upper and isinstance(value, str) else value
        if candidate not in choices:
            raise ValueError(f"must be one of {list(choices)}")
        return str(candidate)

    return check


def optional(inner: Check) -> Check:
    """``None``, or what ``inner`` accepts (its message then says "or None")."""

    def check(value: Any) -> Any:
        if value is None:
            return None
        try:
            return inner(value)
        except ValueError as exc:
            raise ValueError(f"{exc} or None") from None

    return check
