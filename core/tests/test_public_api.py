"""The public faces stay small and in tiers: users, backend authors, the kit."""

from __future__ import annotations

import importlib
import inspect

import executor_core
import executor_core.backend
import executor_core.testing


def test_users_face_is_small() -> None:
    assert len(executor_core.__all__) <= 25


def test_lazy_table_and_all_are_equal() -> None:
    assert sorted(executor_core._LAZY) == sorted(executor_core.__all__)


def test_every_users_name_resolves_and_is_documented() -> None:
    for name in executor_core.__all__:
        obj = getattr(executor_core, name)
        module = importlib.import_module(executor_core._LAZY[name], "executor_core")
        assert getattr(module, name) is obj
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__doc__, f"executor_core.{name} has no docstring"


def test_backend_authors_face_resolves_and_is_documented() -> None:
    for module in (executor_core.backend, executor_core.testing):
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                assert obj.__doc__, f"{module.__name__}.{name} has no docstring"


def test_executor_offers_no_backend_helpers_to_users() -> None:
    public = {name for name in dir(executor_core.Executor) if not name.startswith("_")}
    assert not public & {"resolve_timeout", "check_reply_rank", "add_cleanup", "check_open"}
    assert not public & {"uses_ray", "supports_pp"}
