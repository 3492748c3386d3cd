"""backend_options are parsed one way for every backend (executor_core.options)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from executor_core import ConfigError
from executor_core.options import (
    boolean,
    integer,
    number,
    one_of,
    option,
    optional,
    parse_backend_options,
    text,
)


@attrs.frozen(kw_only=True)
class _Options:
    slots: int = option(4, integer(at_least=2))
    spin_s: float = option(5e-5, number(at_least=0.0, at_most=0.01))
    timeout: float = option(60.0, number(above=0.0))
    fast: bool = option(True, boolean())
    mode: str = option("PACK", one_of("PACK", "SPREAD", upper=True))
    address: str | None = option(None, optional(text()))
    extra: dict[str, Any] = option({}, lambda v: dict(v))


def test_defaults_and_converted_values() -> None:
    parsed = parse_backend_options(_Options, {"mode": "spread", "timeout": 2}, "demo")
    assert parsed == _Options(mode="SPREAD", timeout=2.0)
    assert parse_backend_options(_Options, {}, "demo").extra == {}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"slots": 1}, "'slots' must be an integer >= 2"),
        ({"slots": True}, "'slots' must be an integer >= 2"),
        ({"spin_s": 1.0}, "'spin_s' must be a number <= 0.01"),
        ({"timeout": 0}, "'timeout' must be a number > 0"),
        ({"timeout": float("nan")}, "'timeout' must be a number"),
        ({"fast": 1}, "'fast' must be True or False"),
        ({"mode": "ring"}, "'mode' must be one of ['PACK', 'SPREAD']"),
        ({"address": ""}, "'address' must be a non-empty string or None"),
    ],
)
def test_bad_values_name_the_key(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_backend_options(_Options, options, "demo")
    assert info.value.field == "backend_options"
    assert message in str(info.value)


def test_unknown_keys_list_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['slot'\] for the 'demo' backend"):
        parse_backend_options(_Options, {"slot": 3}, "demo")
