"""The run's two phases: the sides that need Ray are measured after the others, and Ray's
processes run only while they are (fake sides and a fake Ray session: no process starts)."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from executor_bench import _run
from executor_bench._config import BenchConfig
from executor_bench._run import Bench
from executor_bench._sides import SideSpec
from executor_core.backend import PLUGINS_ENV_VAR


class FakeRay:
    """Stands in for :class:`~executor_bench._ray_session.RaySession`: records whether Ray
    is up; ``fail`` makes ``start`` raise."""

    up: ClassVar[bool] = False
    fail: ClassVar[Exception | None] = None
    log: ClassVar[list[str]] = []

    def __init__(self) -> None:
        self.start_s = 0.0

    def start(self, workers: int) -> None:
        if FakeRay.fail is not None:
            raise FakeRay.fail
        FakeRay.up = True
        FakeRay.log.append("ray start")

    def close(self) -> None:
        if FakeRay.up:
            FakeRay.log.append("ray close")
        FakeRay.up = False


class FakeSide:
    """Answers every call as a bench worker would, and records whether Ray was up."""

    def __init__(self, name: str, workers: int) -> None:
        self.name = name
        self.workers = workers
        FakeRay.log.append(f"start {name}")

    def call(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        FakeRay.log.append(f"call {self.name} ray={'up' if FakeRay.up else 'down'}")
        return [len(args[0]) if args else None] * self.workers

    def close(self) -> None:
        FakeRay.log.append(f"close {self.name}")


def _spec(name: str, needs_ray: bool) -> SideSpec:
    return SideSpec(
        name,
        "baseline",
        2,
        "fake",
        start=lambda: FakeSide(name, 2),
        needs_ray=needs_ray,
    )


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Bench:
    """A quick run of the back-to-back no-op and start-up over four fake sides, two of them
    on Ray, listed first so that the run's order cannot come from the list's."""
    monkeypatch.setenv(PLUGINS_ENV_VAR, "uniproc")  # kept as set: the run changes no env
    monkeypatch.setattr(_run, "RaySession", FakeRay)
    monkeypatch.setattr(FakeRay, "up", False)
    monkeypatch.setattr(FakeRay, "fail", None)
    monkeypatch.setattr(FakeRay, "log", [])
    config = BenchConfig(
        backends=["uni"],
        baselines=[],
        sizes=[],
        kinds=["bytes"],
        workloads=["hot", "startup"],
        repeats=2,
        workers=2,
        quick=True,
        idle_s=0.0,
        vllm_path=None,
        progress=False,
    )
    bench = Bench(config)
    bench.sides = [
        _spec("on ray 1", True),
        _spec("local 1", False),
        _spec("on ray 2", True),
        _spec("local 2", False),
    ]
    return bench


def test_ray_sides_are_measured_after_the_others_and_only_they_run_beside_ray(
    bench: Bench,
) -> None:
    result = bench.measure()
    log = FakeRay.log
    assert log.count("ray start") == 1
    started = log.index("ray start")
    before, after = log[:started], log[started:]
    # Every local side's calls (its rounds and its start-ups) ran before Ray started, and
    # they were stopped before it did; the Ray sides ran only after.
    assert {"call local 1 ray=down", "call local 2 ray=down"} <= set(before)
    assert {"close local 1", "close local 2"} <= set(before)
    assert not any("on ray" in entry for entry in before)
    assert not any("local" in entry for entry in after)
    assert {"call on ray 1 ray=up", "call on ray 2 ray=up"} <= set(after)
    assert log[-1] == "ray close"
    # Every side has its samples.
    for name in ("on ray 1", "local 1", "on ray 2", "local 2"):
        assert len(result.samples["hot", name]) == 2 * bench.plan.hot_calls
        assert len(result.samples["startup", name]) == bench.plan.startup_samples
    phases = result.facts["phases"]
    assert phases.index("local 1, local 2 (no Ray process running)") < phases.index(
        "on ray 1, on ray 2 (with Ray running)"
    )


def test_ray_that_cannot_start_takes_out_only_the_ray_sides(bench: Bench) -> None:
    FakeRay.fail = RuntimeError("no room for a raylet")
    result = bench.measure()
    assert [side.name for side in result.sides] == ["local 1", "local 2"]
    reasons = {entry.name: entry.reason for entry in result.failed}
    assert reasons == {
        "on ray 1": "could not start: RuntimeError: no room for a raylet",
        "on ray 2": "could not start: RuntimeError: no room for a raylet",
    }
    assert len(result.samples["hot", "local 1"]) == 2 * bench.plan.hot_calls
    assert not any("on ray" in entry for entry in FakeRay.log)
