"""The registry with plugins registered in code (entry points: tests/test_discovery.py)."""

from __future__ import annotations

import pickle
import shlex
import sys
import textwrap
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from executor_core import (
    BackendConflictError,
    BackendLoadError,
    Executor,
    ExecutorConfig,
    ExecutorError,
    UnknownBackendError,
    WorkerBase,
    __version__,
    hookimpl,
)
from executor_core._registry import PluginRegistrationError
from executor_core.backend import BackendSpec, Capabilities, Registry


class _Worker(WorkerBase):
    pass


def _config(**overrides: Any) -> ExecutorConfig:
    return ExecutorConfig(worker_cls=_Worker, **overrides)


def _plugin(*specs: BackendSpec) -> object:
    class Plugin:
        @staticmethod
        @hookimpl
        def executor_register_backends() -> list[BackendSpec]:
            return list(specs)

    return Plugin()


def _executor_class(registry: Registry, name: str) -> type[Executor]:
    """The executor class of backend ``name``, as ``create_executor`` resolves it."""
    return Executor.get_class(_config(backend=name), registry)


def _spec(name: str, *aliases: str, executor: str = "some_module:SomeExecutor") -> BackendSpec:
    return BackendSpec(name=name, aliases=aliases, executor=executor, description=f"{name} test")


@pytest.fixture
def lazy_backend_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A backend module on sys.path that is not imported yet."""
    name = f"lazy_backend_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            from executor_core import Executor

            class LazyExecutor(Executor):
                def _init_executor(self): pass
                def collective_rpc(self, method, timeout=None, args=(), kwargs=None,
                                   non_block=False, unique_reply_rank=None):
                    return []

            NOT_AN_EXECUTOR = object()
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_get_by_name_and_alias_fills_plugin_info() -> None:
    registry = Registry()
    assert registry.register_plugin(
        _plugin(_spec("alpha", "a")), "alpha-plugin", distribution="alpha-dist", version="1.2"
    )
    spec = registry.get("a")
    assert spec.name == "alpha"
    assert (spec.plugin, spec.distribution, spec.version) == ("alpha-plugin", "alpha-dist", "1.2")
    assert registry.names() == ["alpha"]


def test_executor_class_is_imported_only_when_chosen(lazy_backend_module: str) -> None:
    registry = Registry()
    registry.register_plugin(
        _plugin(_spec("lazy", executor=f"{lazy_backend_module}:LazyExecutor")), "p"
    )
    assert registry.get("lazy").name == "lazy"
    assert lazy_backend_module not in sys.modules
    cls = _executor_class(registry, "lazy")
    assert cls.__name__ == "LazyExecutor"
    assert issubclass(cls, Executor)
    assert lazy_backend_module in sys.modules


def test_executor_class_errors(lazy_backend_module: str) -> None:
    registry = Registry()
    registry.register_plugin(
        _plugin(
            _spec("missing-module", executor="no_such_module_xyz:Executor"),
            _spec("not-executor", executor=f"{lazy_backend_module}:NOT_AN_EXECUTOR"),
            BackendSpec(name="needs-dist", executor="x:Y", requires=("no-such-distribution-xyz",)),
        ),
        "p",
    )
    with pytest.raises(BackendLoadError, match="failed to import 'no_such_module_xyz:Executor'"):
        _executor_class(registry, "missing-module")
    with pytest.raises(BackendLoadError, match="is not an Executor subclass"):
        _executor_class(registry, "not-executor")
    with pytest.raises(BackendLoadError, match="pip install no-such-distribution-xyz"):
        _executor_class(registry, "needs-dist")


def test_conflicts_are_reported_not_resolved() -> None:
    registry = Registry()
    registry.register_plugin(_plugin(_spec("dup")), "first", distribution="first-dist")
    registry.register_plugin(_plugin(_spec("other", "dup")), "second", distribution="second-dist")
    assert set(registry.conflicts()) == {"dup"}
    with pytest.raises(BackendConflictError) as info:
        registry.get("dup")
    message = str(info.value)
    assert "first-dist" in message
    assert "second-dist" in message
    assert "EXECUTOR_PLUGINS" in message
    assert registry.get("other").plugin == "second"  # the non-conflicting name still works


def test_unknown_backend_lists_available_and_install_hint() -> None:
    registry = Registry()
    registry.register_plugin(_plugin(_spec("alpha", "a")), "alpha")
    with pytest.raises(UnknownBackendError) as info:
        registry.get("ray")
    message = str(info.value)
    assert "unknown executor backend 'ray'" in message
    assert "Available backends: a, alpha." in message
    assert "pip install executor-plugin-ray" in message
    assert "failed to load" not in message  # nothing broken: registering never records


class _BadHook:
    @staticmethod
    @hookimpl
    def executor_select_backend(config: Any, nonsense: Any) -> None:
        return None


class _UnknownHook:
    @staticmethod
    @hookimpl
    def executor_no_such_hook() -> None:
        return None


class _Raises:
    @staticmethod
    @hookimpl
    def executor_register_backends() -> list[BackendSpec]:
        raise RuntimeError("cannot declare")


class _WrongType:
    @staticmethod
    @hookimpl
    def executor_register_backends() -> list[object]:
        return ["not a spec"]


class _NotIterable:
    @staticmethod
    @hookimpl
    def executor_register_backends() -> None:
        return None


def _forgot_hookimpl() -> types.ModuleType:
    forgot = types.ModuleType("forgot_hookimpl")

    def executor_register_backends() -> list[BackendSpec]:
        return [_spec("never-seen")]

    forgot.executor_register_backends = executor_register_backends  # type: ignore[attr-defined]
    return forgot


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        pytest.param(
            _BadHook,
            "PluginValidationError: Plugin 'bad' for hook 'executor_select_backend'",
            id="argument-not-in-spec",
        ),
        pytest.param(
            _UnknownHook,
            "PluginValidationError: unknown hook 'executor_no_such_hook'",
            id="unknown",
        ),
        pytest.param(
            _Raises,
            "executor_register_backends raised RuntimeError: cannot declare",
            id="declaring-raises",
        ),
        pytest.param(
            _WrongType,
            "executor_register_backends must return BackendSpec objects, got str",
            id="not-a-spec",
        ),
        pytest.param(
            _NotIterable,
            "executor_register_backends raised TypeError: 'NoneType' object is not iterable",
            id="not-iterable",
        ),
        pytest.param(
            _forgot_hookimpl,
            "registers no hook implementation: did you forget @hookimpl on "
            "executor_register_backends? (from executor_core import hookimpl)",
            id="forgot-hookimpl",
        ),
        pytest.param(
            object,
            "registers no hook implementation: no function is decorated with "
            "@executor_core.hookimpl",
            id="no-hook-at-all",
        ),
    ],
)
def test_a_bad_plugin_is_refused_and_nothing_of_it_stays(make: Any, expected: str) -> None:
    registry = Registry()
    registry.register_plugin(_plugin(_spec("good")), "good")
    bad = make()
    with pytest.raises(PluginRegistrationError) as info:
        registry.register_plugin(bad, "bad", distribution="bad-dist")
    error = info.value
    assert isinstance(error, ExecutorError)
    assert isinstance(error, ValueError)  # as pluggy's error for a taken name
    assert error.plugin_name == "bad"
    assert error.reason.startswith(expected), error.reason
    assert str(error) == f"cannot register plugin 'bad': {error.reason}"
    assert not registry.plugin_manager.is_registered(bad)
    assert registry.plugin_manager.get_plugin("bad") is None
    assert registry.plugins == {"good": ("", "")}
    assert registry.names() == ["good"]
    assert registry.broken == []  # only loading entry points records a broken plugin
    # Later registrations still validate, and the refused name is free.
    assert registry.register_plugin(_plugin(_spec("late")), "bad") == "bad"
    assert registry.names() == ["good", "late"]


def test_a_refused_plugin_error_chains_the_cause_and_pickles() -> None:
    with pytest.raises(PluginRegistrationError) as info:
        Registry().register_plugin(_Raises(), "raises")
    assert isinstance(info.value.__cause__, RuntimeError)
    assert str(info.value.__cause__) == "cannot declare"
    copy = pickle.loads(pickle.dumps(info.value))
    assert (copy.plugin_name, copy.reason, str(copy)) == (
        "raises",
        info.value.reason,
        str(info.value),
    )


def test_a_taken_name_or_a_plugin_registered_twice_is_refused() -> None:
    registry = Registry()
    first = _plugin(_spec("one"))
    assert registry.register_plugin(first, "same") == "same"
    with pytest.raises(PluginRegistrationError, match="the name 'same' is taken by another plugin"):
        registry.register_plugin(_plugin(_spec("two")), "same")
    with pytest.raises(PluginRegistrationError, match="already registered, as 'same'"):
        registry.register_plugin(first, "other")
    # The name of the core's own selection rule is taken too.
    with pytest.raises(PluginRegistrationError, match="is taken"):
        registry.register_plugin(_plugin(_spec("x")), "executor_core.builtin_selection")
    assert registry.names() == ["one"]
    assert registry.get("one").plugin == "same"
    assert registry.plugin_manager.get_plugin("same") is first


def test_a_plugin_unregistered_through_pluggy_is_gone_and_its_name_free() -> None:
    registry = Registry()
    registry.register_plugin(_plugin(_spec("one")), "p")
    registry.register_plugin(_plugin(_spec("two")), "q")
    registry.plugin_manager.unregister(name="p")
    assert registry.names() == ["two"]
    assert set(registry.plugins) == {"q"}
    registry.register_plugin(_plugin(_spec("three")), "p")
    assert registry.names() == ["two", "three"]  # registration order


def test_backends_are_declared_once_at_registration() -> None:
    calls = []

    class Counting:
        @staticmethod
        @hookimpl
        def executor_register_backends() -> list[BackendSpec]:
            calls.append(1)
            return [_spec("counted")]

    registry = Registry()
    registry.register_plugin(Counting(), "counting")
    assert len(calls) == 1
    for _ in range(3):
        assert registry.get("counted").plugin == "counting"
        assert registry.names() == ["counted"]
    assert len(calls) == 1


@pytest.mark.parametrize(
    ("available", "overrides", "expected"),
    [
        (["uni", "mp", "ray"], {}, "uni"),
        (["uni", "mp", "ray"], {"tensor_parallel_size": 2}, "mp"),
        (["uni", "mp", "ray"], {"tensor_parallel_size": 2, "num_nodes": 2}, "ray"),
        (["mp"], {}, "mp"),
    ],
)
def test_builtin_auto_selection(
    available: list[str], overrides: dict[str, Any], expected: str
) -> None:
    registry = Registry()
    registry.register_plugin(_plugin(*(_spec(name) for name in available)), "all")
    assert registry.resolve_name(_config(backend="auto", **overrides)) == expected


def test_auto_without_a_suitable_backend_explains() -> None:
    registry = Registry()
    registry.register_plugin(_plugin(_spec("uni")), "uni")
    with pytest.raises(UnknownBackendError, match="executor-plugin-multiproc"):
        registry.resolve_name(_config(tensor_parallel_size=2))
    with pytest.raises(UnknownBackendError, match="num_nodes=2"):
        registry.resolve_name(_config(num_nodes=2))


def test_plugin_selection_hook_runs_before_builtin_rule() -> None:
    registry = Registry()

    class Chooser:
        @staticmethod
        @hookimpl
        def executor_register_backends() -> list[BackendSpec]:
            return [_spec("tpu"), _spec("uni")]

        @staticmethod
        @hookimpl
        def executor_select_backend(config: ExecutorConfig, available: Sequence[str]) -> str | None:
            return "tpu" if config.device == "tpu" else None

    registry.register_plugin(Chooser(), "chooser")
    assert registry.resolve_name(_config(device="tpu")) == "tpu"
    assert registry.resolve_name(_config(device="cpu")) == "uni"


def test_get_class_bypasses_discovery(lazy_backend_module: str) -> None:
    empty = Registry()
    by_qualname = Executor.get_class(
        _config(backend=f"{lazy_backend_module}:LazyExecutor"), registry=empty
    )
    assert by_qualname.__name__ == "LazyExecutor"
    assert Executor.get_class(_config(backend=by_qualname), registry=empty) is by_qualname
    with pytest.raises(BackendLoadError, match="cannot import"):
        Executor.get_class(_config(backend="nowhere_xyz:Thing"), registry=empty)
    with pytest.raises(BackendLoadError, match="not an Executor subclass"):
        Executor.get_class(
            _config(backend=f"{lazy_backend_module}:NOT_AN_EXECUTOR"), registry=empty
        )


def test_backend_spec_validation() -> None:
    with pytest.raises(ValueError, match="executor"):
        BackendSpec(name="x", executor="not a qualname")
    spec = BackendSpec(
        name="x",
        executor="m:C",
        aliases="single",
        capabilities=Capabilities(pipeline_parallel=True, multi_node=True, devices=("cpu", "cuda")),
    )
    assert spec.aliases == ("single",)
    assert spec.capabilities.describe() == "pp, multi-node, cpu/cuda"


def test_requires_takes_pep508_specifiers(lazy_backend_module: str) -> None:
    executor = f"{lazy_backend_module}:LazyExecutor"
    registry = Registry()
    registry.register_plugin(
        _plugin(
            BackendSpec(
                name="met",
                executor=executor,
                requires=(
                    "pytest>=1",
                    "pluggy[extra]>=1.0; python_version >= '3.10'",
                    "no-such-distribution-xyz>=1; python_version < '3'",  # does not apply
                ),
            ),
            BackendSpec(
                name="unmet",
                executor=executor,
                requires=("pytest>=999", "no-such-distribution-xyz[cuda]>=2.10; os_name != 'x'"),
            ),
        ),
        "p",
    )
    assert _executor_class(registry, "met").__name__ == "LazyExecutor"
    with pytest.raises(BackendLoadError) as info:
        _executor_class(registry, "unmet")
    message = str(info.value)
    installed_pytest = pytest.__version__
    assert f"pytest>=999 ({installed_pytest} installed)" in message
    assert "no-such-distribution-xyz[cuda]>=2.10 (not installed)" in message
    # The hint pastes into a shell: each requirement quoted, the marker left out.
    command = message.split(": ", 1)[1]
    assert command == "pip install 'pytest>=999' 'no-such-distribution-xyz[cuda]>=2.10'"
    assert shlex.split(command)[2:] == ["pytest>=999", "no-such-distribution-xyz[cuda]>=2.10"]


def test_backend_spec_rejects_invalid_requirements() -> None:
    with pytest.raises(ValueError, match="'ray >= = 2' is not a PEP 508 requirement"):
        BackendSpec(name="x", executor="m:C", requires=("ray >= = 2",))
    assert BackendSpec(name="x", executor="m:C", requires="ray>=2.10").requires == ("ray>=2.10",)


def test_plugin_for_another_core_is_listed_but_never_used() -> None:
    registry = Registry()

    class Future:
        @staticmethod
        @hookimpl
        def executor_register_backends() -> list[BackendSpec]:
            return [_spec("future", "uni")]

        @staticmethod
        @hookimpl
        def executor_select_backend(config: ExecutorConfig, available: Sequence[str]) -> str:
            return "future"

    assert registry.register_plugin(_plugin(_spec("uni")), "uniproc")
    assert registry.register_plugin(
        Future(),
        "future-plugin",
        distribution="future-dist",
        version="9.0",
        core_requirement="executor-core>=99",
    )
    reason = f"requires executor-core>=99; installed {__version__}"
    assert registry.incompatible_plugins == {"future-plugin": ("future-dist", "9.0", reason)}
    assert "future-plugin" not in registry.plugins
    future = next(s for s in registry.backends() if s.name == "future")
    assert future.incompatible == reason
    assert registry.names() == ["uni"]
    # Its alias does not conflict with the working backend, and its hooks never run.
    assert registry.conflicts() == {}
    assert registry.get("uni").plugin == "uniproc"
    assert registry.resolve_name(_config(backend="auto")) == "uni"
    with pytest.raises(BackendLoadError) as info:
        _executor_class(registry, "future")
    message = str(info.value)
    for part in ("'future'", "future-plugin", "future-dist 9.0", "executor-core>=99", __version__):
        assert part in message
    assert "pip install 'executor-core>=99'" in message
    with pytest.raises(BackendLoadError, match="future-dist"):
        registry.resolve_name(_config(backend="future"))
    with pytest.raises(UnknownBackendError, match="built for another executor-core"):
        registry.get("nothing")


def test_core_requirement_that_is_met_changes_nothing() -> None:
    registry = Registry()
    assert registry.register_plugin(
        _plugin(_spec("now")), "now", core_requirement=f"executor-core>={__version__}"
    )
    assert registry.get("now").incompatible == ""
    assert registry.incompatible_plugins == {}


def test_auto_with_only_a_third_party_backend_says_how_to_choose_it() -> None:
    registry = Registry()
    registry.register_plugin(_plugin(_spec("threads")), "threads")
    with pytest.raises(UnknownBackendError) as info:
        registry.resolve_name(_config(tensor_parallel_size=2))
    message = str(info.value)
    assert "no installed backend can run" not in message
    assert "picks only from the built-in backends uni/mp/ray" in message
    assert "Installed: threads; pass backend='threads' to use it." in message
    assert "pip install executor-plugin-multiproc" in message
    with pytest.raises(UnknownBackendError) as info:
        registry.resolve_name(_config(num_nodes=2))
    message = str(info.value)
    assert "Installed: threads; none declares multi-node support." in message
    assert "pip install executor-plugin-ray" in message


def test_a_bad_plugin_for_another_core_is_refused_with_both_reasons() -> None:
    with pytest.raises(PluginRegistrationError) as info:
        Registry().register_plugin(_Raises(), "raises", core_requirement="executor-core>=99")
    assert info.value.reason == (
        "executor_register_backends raised RuntimeError: cannot declare "
        f"(requires executor-core>=99; installed {__version__})"
    )
