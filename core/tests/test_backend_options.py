"""The core owns the backend_options rule: every backend refuses a key it does not take,
listing the keys it does, before anything starts; a backend that takes none says so."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import pytest

from executor_core import ConfigError, Executor, ExecutorConfig, create_executor
from executor_core.backend import Call, Transport, TransportHost
from executor_core.options import NoOptions, integer, option
from executor_core.testing import ConformanceWorker


class _RecordingTransport(Transport):
    """Counts how often the core built it: a refused config must never get this far."""

    built: ClassVar[int] = 0

    def __init__(self, host: TransportHost) -> None:
        super().__init__(host)
        type(self).built += 1

    def start(self) -> None:
        pass

    def send(self, call: Call) -> bool:
        self.host.deliver(call.seq, 0, True, None)
        return True

    def close(self, graceful: bool) -> None:
        pass


@attrs.frozen(kw_only=True)
class _DemoOptions:
    depth: int = option(3, integer(at_least=1))
    width: int = option(8, integer(at_least=1))


class _NoOptionsExecutor(Executor):
    """A third-party backend that declares no options."""

    transport_cls = _RecordingTransport


class _DemoExecutor(Executor):
    """A third-party backend with options of its own."""

    transport_cls = _RecordingTransport
    options_cls = _DemoOptions


def _config(backend: Any, **options: Any) -> ExecutorConfig:
    return ExecutorConfig(worker_cls=ConformanceWorker, backend=backend, backend_options=options)


@pytest.fixture(autouse=True)
def _count_from_zero() -> None:
    _RecordingTransport.built = 0


@pytest.mark.parametrize("backend", ["uni", "external_launcher", "threads", _NoOptionsExecutor])
def test_a_backend_without_options_refuses_every_key(backend: Any) -> None:
    name = backend if isinstance(backend, str) else backend.__qualname__
    with pytest.raises(ConfigError) as info:
        create_executor(_config(backend, slots=4))
    assert info.value.field == "backend_options"
    assert info.value.value == {"slots": 4}
    assert f"the {name!r} backend takes no backend_options; leave them empty" in str(info.value)
    assert _RecordingTransport.built == 0


def test_a_backend_without_options_starts_without_them() -> None:
    assert Executor.options_cls is NoOptions
    with create_executor(_config(_NoOptionsExecutor)) as executor:
        assert executor.collective_rpc("anything") == [None]
    assert _RecordingTransport.built == 1


def test_an_unknown_key_lists_the_known_ones_before_the_transport_is_built() -> None:
    with pytest.raises(ConfigError) as info:
        create_executor(_config(_DemoExecutor, depth=2, colour="red", breadth=1))
    assert info.value.value == {"breadth": 1, "colour": "red"}  # the unknown keys alone
    assert (
        "unknown key(s) ['breadth', 'colour'] for the '_DemoExecutor' backend; "
        "known keys: ['depth', 'width']"
    ) in str(info.value)
    assert _RecordingTransport.built == 0


def test_a_bad_value_is_refused_by_the_core() -> None:
    with pytest.raises(ConfigError, match=r"'depth' must be an integer >= 1"):
        create_executor(_config(_DemoExecutor, depth=0))
    assert _RecordingTransport.built == 0
    with create_executor(_config(_DemoExecutor, depth=2)) as executor:
        assert executor.collective_rpc("anything") == [None]


@pytest.mark.parametrize(("backend", "known"), [("mp", "'start_method'"), ("ray", "'address'")])
def test_the_in_tree_backends_name_their_keys(backend: str, known: str) -> None:
    with pytest.raises(
        ConfigError, match=rf"unknown key\(s\) \['slotz'\] for the {backend!r}"
    ) as info:
        create_executor(_config(backend, slotz=3))
    assert known in str(info.value)
    assert "'slots'" in str(info.value)  # the channel's keys, shared by both


def test_an_options_class_that_is_not_attrs_is_a_backend_bug() -> None:
    class _Broken(Executor):
        transport_cls = _RecordingTransport
        options_cls = dict  # type: ignore[assignment]  # the mistake under test

    with pytest.raises(TypeError, match=r"_Broken.options_cls must be an attrs class"):
        create_executor(_config(_Broken))
    assert _RecordingTransport.built == 0
