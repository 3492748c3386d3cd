"""How calls and replies cross Ray: pickled bytes when cheaper, Ray's serializer otherwise."""

from __future__ import annotations

import pickle
import sys
import threading
from collections.abc import Iterator
from typing import Any

import cloudpickle  # type: ignore[import-untyped]  # no type information
import numpy as np
import pytest
import ray

from executor_core import create_executor
from executor_core.testing import conformance_config
from executor_plugin_ray._encoding import Carried, decode_reply, encode_call, encode_reply, pack
from executor_plugin_ray._executor import RayExecutor

pytestmark = pytest.mark.usefixtures("ray_local")

# The helpers below run inside the Ray workers, which cannot import this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

BIG = 200 * 1024  # above the size at which an argument is lifted out of the call


@pytest.fixture(scope="module")
def executor() -> Iterator[RayExecutor]:
    created = create_executor(
        conformance_config("ray", world_size=2, backend_options={"log_to_driver": False})
    )
    assert isinstance(created, RayExecutor)
    try:
        yield created
    finally:
        created.shutdown()


class Point:
    """A class pickled by value (like one defined in a driver script's ``__main__``)."""

    def __init__(self, x: int) -> None:
        self.x = x


def test_small_values_are_pickled_and_ray_handles_are_left_to_ray() -> None:
    data = pack(["get_rank", [1, "a", Point(3)], None, None, []])
    assert isinstance(data, bytes)
    assert pickle.loads(data)[1][2].x == 3
    assert pack(lambda worker: worker.rank) is not None  # cloudpickle, as Ray would
    ref = ray.put(1)
    assert pack([ref]) is None  # Ray counts references to object refs it carries
    assert pack({"array": np.zeros(4)}) is None  # out-of-band buffers: Ray avoids a copy
    assert pack(threading.Lock()) is None  # unpicklable: Ray's serializer reports it


def test_replies_round_trip_whatever_the_result_is() -> None:
    array = np.arange(6.0)
    for result in (b"\x80\x05raw bytes", "text", 3, {"k": [1, 2]}, Point(5)):
        reply = encode_reply(result)
        assert isinstance(reply, bytes)
        decoded = decode_reply(reply)
        assert type(decoded) is type(result)
        if isinstance(result, Point):
            assert decoded.x == 5
        else:
            assert decoded == result
    carried = encode_reply(array)
    assert isinstance(carried, Carried)
    assert decode_reply(carried) is array
    assert encode_reply(None) is None


def test_call_encodings(executor: RayExecutor) -> None:
    small, lifted = encode_call("f", (1, 2), {"k": 3}, None, world_size=2)
    assert isinstance(small, bytes)
    assert lifted == []
    with_ref, lifted = encode_call("f", (ray.put(1),), None, None, world_size=2)
    assert isinstance(with_ref, list)
    assert lifted == []
    big, lifted = encode_call("f", (1, b"x" * BIG, 2), None, None, world_size=2)
    assert pickle.loads(big) == ["f", [1, None, 2], None, None, [1]]
    # Two workers: the lifted argument is put into the object store once for both.
    assert len(lifted) == 1
    assert isinstance(lifted[0], ray.ObjectRef)
    # One worker: it crosses as the Ray call's own argument, with no extra put.
    _big, lifted = encode_call("f", (b"x" * BIG,), None, None, world_size=1)
    assert lifted == [b"x" * BIG]


def _describe(worker: Any, *args: Any, **kwargs: Any) -> list[Any]:
    import ray

    described = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, ray.ObjectRef):
            described.append(("ref", ray.get(value)))
        elif isinstance(value, bytes):
            described.append(("bytes", len(value), value[:1]))
        elif callable(value):
            described.append(("callable", value(worker.rank)))
        else:
            described.append(("value", value))
    return described


def test_arguments_arrive_as_sent_on_every_path(executor: RayExecutor) -> None:
    ref = ray.put("stored")
    replies = executor.collective_rpc(
        _describe,
        args=(1, b"a" * BIG, ref, lambda rank: rank * 10, b"b" * BIG),
        kwargs={"last": "k"},
    )
    for rank, described in enumerate(replies):
        assert described == [
            ("value", 1),
            ("bytes", BIG, b"a"),
            ("ref", "stored"),  # an object ref stays a reference, as on Ray's own path
            ("callable", rank * 10),
            ("bytes", BIG, b"b"),
            ("value", "k"),
        ]
    # Large keyword arguments go through Ray's serializer, put once for both workers.
    [described] = executor.collective_rpc(
        _describe, kwargs={"blob": b"c" * BIG}, unique_reply_rank=1
    )
    assert described == [("bytes", BIG, b"c")]


def _result_of_kind(worker: Any, kind: str) -> Any:
    import numpy as np

    return {
        "bytes": b"\x80\x05looks pickled",
        "array": np.full(3, worker.rank, dtype=np.float32),
        "none": None,
        "object": Point(worker.rank),
    }[kind]


def test_results_arrive_as_returned(executor: RayExecutor) -> None:
    assert (
        executor.collective_rpc(_result_of_kind, args=("bytes",)) == [b"\x80\x05looks pickled"] * 2
    )
    arrays = executor.collective_rpc(_result_of_kind, args=("array",))
    for rank, array in enumerate(arrays):
        assert array.dtype == np.float32
        assert array.tolist() == [rank] * 3
    assert executor.collective_rpc(_result_of_kind, args=("none",)) == [None, None]
    points = executor.collective_rpc(_result_of_kind, args=("object",))
    assert [p.x for p in points] == [0, 1]


def test_an_unpicklable_argument_fails_clearly(executor: RayExecutor) -> None:
    with pytest.raises(TypeError, match="serialize"):
        executor.collective_rpc("echo", args=(threading.Lock(),))
    assert executor.collective_rpc("get_rank") == [0, 1]  # still usable
