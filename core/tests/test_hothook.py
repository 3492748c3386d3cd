"""HotHook calls a hook's implementations as pluggy would: same functions, same arguments,
same order, wrappers through pluggy, plugins registered or removed at any time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pluggy
import pytest

from executor_core._hothook import HotHook

spec = pluggy.HookspecMarker("hothook-test")
impl = pluggy.HookimplMarker("hothook-test")


class Spec:
    @spec
    def observed(self, a: int, b: str, c: float) -> None:
        """A call was observed."""


def _manager() -> pluggy.PluginManager:
    manager = pluggy.PluginManager("hothook-test")
    manager.add_hookspecs(Spec)
    return manager


class Recorder:
    def __init__(self, name: str, log: list[tuple[str, Any]]) -> None:
        self.name, self.log = name, log

    @impl
    def observed(self, a: int, b: str, c: float) -> None:
        self.log.append((self.name, (a, b, c)))


class Partial:
    """Takes a subset of the arguments, in another order than the spec's."""

    def __init__(self, log: list[tuple[str, Any]]) -> None:
        self.log = log

    @impl(tryfirst=True)
    def observed(self, c: float, a: int) -> None:
        self.log.append(("partial", (c, a)))


class Last:
    def __init__(self, log: list[tuple[str, Any]]) -> None:
        self.log = log

    @impl(trylast=True)
    def observed(self, b: str) -> None:
        self.log.append(("last", b))


def _both_ways(manager: pluggy.PluginManager, values: tuple[Any, ...]) -> tuple[list, list]:
    """What pluggy's own call logs, and what HotHook's logs."""
    log: list[tuple[str, Any]] = []
    for plugin in manager.get_plugins():
        plugin.log = log
    manager.hook.observed(a=values[0], b=values[1], c=values[2])
    by_pluggy = list(log)
    log.clear()
    call = HotHook(manager.hook.observed).current()
    assert call is not None
    call(*values)
    return by_pluggy, list(log)


def test_same_calls_in_the_same_order_as_pluggy() -> None:
    manager = _manager()
    log: list[tuple[str, Any]] = []
    manager.register(Last(log))
    manager.register(Recorder("first", log))
    manager.register(Partial(log))
    manager.register(Recorder("second", log))
    by_pluggy, by_hot = _both_ways(manager, (1, "x", 2.5))
    assert by_hot == by_pluggy
    assert by_hot[0] == ("partial", (2.5, 1))
    assert by_hot[-1] == ("last", "x")


def test_inactive_without_implementations_and_follows_registration() -> None:
    manager = _manager()
    hot = HotHook(manager.hook.observed)
    assert hot.current() is None
    log: list[tuple[str, Any]] = []
    plugin = Recorder("late", log)
    manager.register(plugin)
    call = hot.current()
    assert call is not None
    call(3, "y", 0.5)
    assert log == [("late", (3, "y", 0.5))]
    manager.unregister(plugin)
    assert hot.current() is None


def test_a_lone_implementation_taking_every_argument_is_called_as_it_is() -> None:
    manager = _manager()
    log: list[tuple[str, Any]] = []
    plugin = Recorder("only", log)
    manager.register(plugin)
    assert HotHook(manager.hook.observed).current() == plugin.observed
    manager.register(Partial(log))
    call = HotHook(manager.hook.observed).current()
    assert call is not None
    assert call != plugin.observed
    call(1, "x", 2.5)
    assert log == [("partial", (2.5, 1)), ("only", (1, "x", 2.5))]


class Wrapper:
    def __init__(self, log: list[tuple[str, Any]]) -> None:
        self.log = log

    @impl(wrapper=True)
    def observed(self, a: int) -> Iterator[None]:
        self.log.append(("before", a))
        yield
        self.log.append(("after", a))


def test_wrappers_go_through_pluggy() -> None:
    manager = _manager()
    log: list[tuple[str, Any]] = []
    manager.register(Recorder("plain", log))
    manager.register(Wrapper(log))
    call = HotHook(manager.hook.observed).current()
    assert call is not None
    call(4, "z", 1.0)
    assert log == [("before", 4), ("plain", (4, "z", 1.0)), ("after", 4)]


class Failing:
    @impl
    def observed(self, a: int) -> None:
        raise RuntimeError(f"observer failed on {a}")


def test_an_implementation_error_propagates_as_with_pluggy() -> None:
    manager = _manager()
    manager.register(Failing())
    with pytest.raises(RuntimeError, match="observer failed on 5"):
        manager.hook.observed(a=5, b="", c=0.0)
    call = HotHook(manager.hook.observed).current()
    assert call is not None
    with pytest.raises(RuntimeError, match="observer failed on 5"):
        call(5, "", 0.0)


def test_a_hook_without_specification_is_refused() -> None:
    manager = pluggy.PluginManager("hothook-test")

    class Unspecified:
        @impl
        def unknown(self) -> None: ...

    manager.register(Unspecified())
    with pytest.raises(ValueError, match="no specification"):
        HotHook(manager.hook.unknown)
