"""Errors survive pickling and carry what a user needs to act."""

from __future__ import annotations

import pickle

import pytest

from executor_core import (
    ConfigError,
    ExecutorFailedError,
    RPCTimeoutError,
    WorkerDiedError,
    WorkerError,
)
from executor_core.backend import RemoteFailure
from executor_core.testing._workers import UnpicklableError


def _raise_value_error() -> None:
    raise ValueError("bad value 42")


def test_remote_failure_round_trip_keeps_traceback_and_cause() -> None:
    try:
        _raise_value_error()
    except ValueError as exc:
        failure = RemoteFailure.capture(3, "my_method", exc)
    failure = pickle.loads(pickle.dumps(failure))
    error = failure.to_error()
    assert error.rank == 3
    assert error.method == "my_method"
    assert error.exc_type == "ValueError"
    assert error.message == "bad value 42"
    assert "_raise_value_error" in error.remote_traceback
    assert isinstance(error.__cause__, ValueError)
    assert "worker rank 3 raised ValueError in 'my_method'" in str(error)
    assert "_raise_value_error" in str(error)


def test_unpicklable_exception_still_gives_text() -> None:
    failure = RemoteFailure.capture(0, "m", UnpicklableError("nope"))
    assert failure.exc_pickle is None
    error = failure.to_error()
    assert error.original is None
    assert error.exc_type.endswith("UnpicklableError")
    assert error.message == "nope"


@pytest.mark.parametrize(
    "error",
    [
        WorkerError(1, "m", "ValueError", "msg", "Traceback ...", ValueError("msg")),
        WorkerDiedError(2, exitcode=-9, signal=9, detail="node lost"),
        RPCTimeoutError("slow", [0, 1], 1.5),
        RPCTimeoutError("slow", [1], 1.5, WorkerError(0, "slow", "OSError", "busy", "")),
        ConfigError("world_size", 3, "must be 2"),
    ],
)
def test_errors_pickle(error: Exception) -> None:
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is type(error)
    assert str(clone) == str(error)


def test_messages() -> None:
    died = WorkerDiedError(1, exitcode=None, signal=9)
    assert str(died) == "worker rank 1 died (killed by signal 9)"
    assert isinstance(died, ExecutorFailedError)
    timeout = RPCTimeoutError("slow", [1], 0.5)
    assert isinstance(timeout, TimeoutError)
    assert "ranks that did not answer: [1]" in str(timeout)
