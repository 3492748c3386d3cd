"""ExecutorConfig validation: every bad value names the field, the value and what is allowed."""

from __future__ import annotations

import functools
import math
import sys
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import pytest

from executor_core import ConfigError, ExecutorConfig, RecoveryPolicy, WorkerBase


class _Worker(WorkerBase):
    pass


def test_defaults_and_derived_world_size() -> None:
    config = ExecutorConfig(worker_cls=_Worker, tensor_parallel_size=2, pipeline_parallel_size=3)
    assert config.world_size == 6
    assert config.backend == "auto"
    assert config.distributed_host == "127.0.0.1"
    assert config.output_rank == 4  # first TP rank of the last stage
    assert config.rank_of(pp_rank=1, tp_rank=1) == 3


def test_evolve_rederives_world_size() -> None:
    config = ExecutorConfig(worker_cls=_Worker, tensor_parallel_size=2)
    assert config.evolve(pipeline_parallel_size=2).world_size == 4
    assert config.evolve(rpc_timeout=3).rpc_timeout == 3


@pytest.mark.parametrize(
    ("overrides", "field", "hint"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size", ">= 1"),
        ({"pipeline_parallel_size": -1}, "pipeline_parallel_size", ">= 1"),
        ({"tensor_parallel_size": 2, "world_size": 3}, "world_size", "2 * 1 = 2"),
        ({"tensor_parallel_size": True}, "tensor_parallel_size", "integer"),
        ({"num_nodes": 0}, "num_nodes", ">= 1"),
        ({"rpc_timeout": 0}, "rpc_timeout", "> 0"),
        ({"rpc_timeout": "5"}, "rpc_timeout", "> 0"),
        ({"backend": ""}, "backend", "registered backend name"),
        ({"backend": 3}, "backend", "Executor subclass"),
        ({"backend": dict}, "backend", "Executor subclass"),
        ({"worker_cls": "no_colon"}, "worker_cls", "package.module:MyWorker"),
        ({"worker_cls": dict}, "worker_cls", "WorkerBase subclass"),
        ({"env": {"A": 1}}, "env", "strings"),
        ({"env": {"A=B": "x"}}, "env", "without '='"),
        ({"device": ""}, "device", "non-empty"),
        ({"distributed_host": ""}, "distributed_host", "non-empty"),
        ({"num_nodes": -2}, "num_nodes", ">= 1"),
        ({"world_size": 0}, "world_size", ">= 1"),
        ({"tensor_parallel_size": 2.0}, "tensor_parallel_size", "integer"),
        ({"rpc_timeout": -1.5}, "rpc_timeout", "> 0"),
        ({"rpc_timeout": float("nan")}, "rpc_timeout", "> 0"),
        ({"rpc_timeout": False}, "rpc_timeout", "> 0"),
        ({"env": {"": "x"}}, "env", "non-empty"),
        ({"worker_kwargs": {1: "x"}}, "worker_kwargs", "string keys"),
        ({"backend_options": {None: 1}}, "backend_options", "strings"),
        ({"async_scheduling": 1}, "async_scheduling", "True or False"),
        ({"backend": "   "}, "backend", "registered backend name"),
    ],
)
def test_invalid_values_name_field_value_and_rule(
    overrides: dict[str, Any], field: str, hint: str
) -> None:
    kwargs: dict[str, Any] = {"worker_cls": _Worker, **overrides}
    with pytest.raises(ConfigError) as info:
        ExecutorConfig(**kwargs)
    assert info.value.field == field
    message = str(info.value)
    assert f"ExecutorConfig.{field}=" in message
    assert hint in message
    assert info.value.allowed.startswith("must ")
    assert isinstance(info.value, ValueError)


def test_worker_cls_qualname_accepted_and_config_is_frozen() -> None:
    config = ExecutorConfig(worker_cls="executor_core.testing:ConformanceWorker", backend="uni")
    with pytest.raises(AttributeError):
        config.backend = "mp"  # type: ignore[misc]  # frozen: the assignment itself is the test


def test_mappings_are_copied() -> None:
    env = {"A": "1"}
    config = ExecutorConfig(worker_cls=_Worker, env=env)
    env["A"] = "2"
    assert config.env == {"A": "1"}


# --- every field, from its declaration -------------------------------------------------------

#: Values of many types; each field must refuse every one its declared type does not admit.
_SAMPLES: tuple[object, ...] = (
    None,
    True,
    7,
    2.5,
    1j,
    "text",
    b"bytes",
    [1],
    ("t",),
    {"k": 1},
    {"k": "v"},
    {1: "v"},
    object(),
)


def _admits(hint: Any, value: object) -> bool:
    """Whether ``value`` is of the type ``hint`` (a field's annotation, resolved)."""
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_admits(arg, value) for arg in typing.get_args(hint))
    if hint is None or hint is type(None):
        return value is None
    if hint is bool or isinstance(value, bool):  # bool is an int, but never a number here
        return hint is bool and isinstance(value, bool)
    if hint is float:  # the numeric tower: an int is a float
        return isinstance(value, int | float)
    if origin is not None and issubclass(origin, Mapping):
        key_hint, value_hint = typing.get_args(hint)
        return isinstance(value, Mapping) and all(
            _admits(key_hint, key) and _admits(value_hint, val) for key, val in value.items()
        )
    return isinstance(value, origin or hint)


def _accepted_type(field: attrs.Attribute[Any]) -> Any:
    """What ``ExecutorConfig(...)`` takes for ``field``: its converter's argument, else its type."""
    if field.converter is not None:
        hints = typing.get_type_hints(field.converter)
        hints.pop("return", None)
        return next(iter(hints.values()))
    return typing.get_type_hints(ExecutorConfig)[field.name]


_WRONG = [
    pytest.param(field.name, value, id=f"{field.name}-{index}-{type(value).__name__}")
    for field in attrs.fields(ExecutorConfig)
    for index, value in enumerate(_SAMPLES)
    if not _admits(_accepted_type(field), value)
]


def test_every_field_has_wrong_values_to_try() -> None:
    tried = {param.values[0] for param in _WRONG}
    assert tried == {field.name for field in attrs.fields(ExecutorConfig)}


@pytest.mark.parametrize(("field", "value"), _WRONG)
def test_a_value_of_the_wrong_type_names_the_field(field: str, value: object) -> None:
    kwargs: dict[str, Any] = {"worker_cls": _Worker, field: value}
    with pytest.raises(ConfigError) as info:
        ExecutorConfig(**kwargs)
    assert info.value.field == field
    assert info.value.value == value  # (a mapping is copied before it is checked)
    assert f"ExecutorConfig.{field}={value!r}: must " in str(info.value)
    # evolve validates the same way.
    with pytest.raises(ConfigError, match=rf"ExecutorConfig\.{field}="):
        ExecutorConfig(worker_cls=_Worker).evolve(**{field: value})


class _BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr for you")


def test_a_huge_or_hostile_value_still_gives_a_short_message() -> None:
    huge: Any = "x" * 100_000
    with pytest.raises(ConfigError) as info:
        ExecutorConfig(worker_cls=_Worker, async_scheduling=huge)
    message = str(info.value)
    assert len(message) < 400
    assert "(100002 characters)" in message  # the repr's length: the string and its quotes
    assert message.endswith(": must be True or False")
    assert info.value.value is huge
    hostile: Any = _BadRepr()
    with pytest.raises(ConfigError, match=r"=<_BadRepr object \(its repr raised\)>: must be"):
        ExecutorConfig(worker_cls=_Worker, num_nodes=hostile)


def test_preload_worker_imports_the_module_that_defines_the_class(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``executor_core.backend.preload_worker``, what a warm spare runs: by name or by class."""
    from executor_core.backend import preload_worker

    (tmp_path / "spare_target.py").write_text("class Worker:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "spare_target", raising=False)
    preload_worker("spare_target:Worker")
    assert "spare_target" in sys.modules
    preload_worker(sys.modules["spare_target"].Worker)  # a class: its module, imported
    with pytest.raises(ImportError, match="no attribute 'Nope'"):
        preload_worker("spare_target:Nope")


def test_keep_asks_the_host_that_runs_it() -> None:
    """``TransportHost.keep``: after a rank replacement (``_take_over``) the host that took
    over decides: restarting, it keeps the value for the next incarnation; shutting down, it
    releases it."""
    from executor_core.backend import TransportHost

    config = ExecutorConfig(backend="uni", worker_cls="executor_core.testing:ConformanceWorker")
    for restarting in (True, False):
        released: list[str] = []
        first = TransportHost(config, "test", None)
        first.keep("thing", "value", functools.partial(released.append, "thing"))
        second = TransportHost(config, "test", None)
        second._take_over(first)
        first.restarting = not restarting  # the replaced host's state no longer counts
        second.restarting = restarting
        second._release(False)
        assert second.take("thing") == ("value" if restarting else None)
        assert released == ([] if restarting else ["thing"])


#: Every field of seconds, on the config and on its recovery policy.
_SECONDS_FIELDS = [
    ("ExecutorConfig", "rpc_timeout"),
    ("ExecutorConfig", "hang_timeout_s"),
    ("RecoveryPolicy", "window_s"),
    ("RecoveryPolicy", "backoff_s"),
    ("RecoveryPolicy", "rejoin_timeout_s"),
]


@pytest.mark.parametrize(("owner", "field"), _SECONDS_FIELDS)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_no_field_of_seconds_takes_an_infinity_or_nan(owner: str, field: str, value: float) -> None:
    """An infinite or NaN bound is refused where it is given, naming the field (``None`` is
    "no bound" where a field has one): it would otherwise reach a timer that cannot hold it
    (the hang watch's thread died with ``OverflowError`` on ``hang_timeout_s=inf``)."""
    make: Any = ExecutorConfig if owner == "ExecutorConfig" else RecoveryPolicy
    kwargs: dict[str, Any] = {field: value}
    if owner == "ExecutorConfig":
        kwargs["worker_cls"] = _Worker
    with pytest.raises(ConfigError) as info:
        make(**kwargs)
    assert info.value.field.endswith(field)
    assert "finite" in str(info.value) or "number of seconds" in str(info.value)


@pytest.mark.parametrize("value", [math.inf, math.nan, 0, -1.0, True])
def test_a_call_timeout_is_a_finite_number_of_seconds(value: float) -> None:
    """A call's own ``timeout`` is checked as the config's is: an infinity or NaN is refused
    before anything is sent (``None`` is the documented "no bound")."""
    from executor_core import create_executor
    from executor_core.testing import ConformanceWorker

    config = ExecutorConfig(backend="uni", worker_cls=ConformanceWorker)
    with create_executor(config) as executor:
        with pytest.raises(ValueError, match="finite number of seconds > 0, or None"):
            executor.collective_rpc("get_rank", timeout=value)
        assert executor.collective_rpc("get_rank", timeout=None) == [0]
