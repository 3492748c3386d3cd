"""How targets are judged: per-round figures, a bootstrap over rounds, and the verdict."""

from __future__ import annotations

import math
import random

import pytest

from executor_bench._intervals import (
    MIN_UNITS,
    Estimate,
    blocks,
    bootstrap,
    difference_estimate,
    ratio_estimate,
)
from executor_bench._workloads import interleave


def _rounds(
    rng: random.Random, median: float, rounds: int, calls: int, spread: float = 0.2
) -> list[list[float]]:
    """``rounds`` rounds of ``calls`` log-normal samples around ``median`` seconds, each
    round shifted by a noise of its own (the machine's state in that round)."""
    out = []
    for _ in range(rounds):
        shift = rng.gauss(0.0, spread)
        out.append([median * math.exp(shift + rng.gauss(0.0, 0.3)) for _ in range(calls)])
    return out


def _pair(
    ratio: float, *, rounds: int = 10, calls: int = 200, seed: int = 1
) -> tuple[list[list[float]], list[list[float]]]:
    rng = random.Random(seed)
    return _rounds(rng, 20e-6 * ratio, rounds, calls), _rounds(rng, 20e-6, rounds, calls)


@pytest.mark.parametrize("statistic", ["median", "p99"])
def test_a_clear_win_is_met(statistic: str) -> None:
    estimate = ratio_estimate(*_pair(0.4), statistic)
    assert estimate.units == 10
    assert estimate.low <= estimate.point <= estimate.high < 0.8
    assert estimate.verdict(0.8) == "met"


@pytest.mark.parametrize("statistic", ["median", "p99"])
def test_a_clear_loss_is_not_met(statistic: str) -> None:
    estimate = ratio_estimate(*_pair(1.2), statistic)
    assert 0.8 < estimate.low <= estimate.point <= estimate.high
    assert estimate.verdict(0.8) == "not met"


def test_an_interval_across_the_limit_is_undecided() -> None:
    estimate = ratio_estimate(*_pair(0.8), "median")
    assert estimate.low < 0.8 < estimate.high
    assert estimate.verdict(0.8) == "undecided"


def test_too_few_rounds_decide_nothing() -> None:
    estimate = ratio_estimate(*_pair(0.4, rounds=MIN_UNITS - 1), "median")
    assert estimate.high < 0.8
    assert estimate.verdict(0.8) == "undecided"


def test_the_verdict_rule() -> None:
    assert Estimate(0.5, 0.4, 0.6, 10).verdict(0.6) == "met"
    assert Estimate(0.7, 0.61, 0.8, 10).verdict(0.6) == "not met"
    assert Estimate(0.6, 0.5, 0.7, 10).verdict(0.6) == "undecided"


def test_rounds_with_few_calls_are_pooled_into_blocks_for_a_p99() -> None:
    assert blocks([40] * 10, 100) == [range(0, 3), range(3, 6), range(6, 10)]
    assert blocks([1000] * 3, 100) == [range(0, 1), range(1, 2), range(2, 3)]
    assert blocks([40, 40], 100) == [range(0, 2)]
    short = ratio_estimate(*_pair(0.4, rounds=30, calls=40), "p99")
    assert (short.units, short.blocked, short.rounds_per_block) == (10, True, 3)
    assert short.verdict(0.8) == "met"
    # A median needs no pooling: every round counts.
    assert ratio_estimate(*_pair(0.4, rounds=30, calls=40), "median").units == 30
    assert not ratio_estimate(*_pair(0.4), "p99").blocked


def test_a_difference_is_judged_round_by_round() -> None:
    rng = random.Random(3)
    direct = [0.5 + rng.gauss(0.0, 0.05) for _ in range(7)]
    observed = [d + 1.0 + rng.gauss(0.0, 0.1) for d in direct]
    estimate = difference_estimate(observed, direct)
    assert estimate.units == 7
    assert estimate.low <= 1.0 <= estimate.high
    assert estimate.verdict(2.0) == "met"
    assert estimate.verdict(0.5) == "not met"


def test_the_interval_is_reproducible() -> None:
    rng = random.Random(7)
    values = [rng.random() for _ in range(9)]
    assert bootstrap(values) == bootstrap(values)
    assert ratio_estimate(*_pair(0.5), "p99") == ratio_estimate(*_pair(0.5), "p99")


def test_the_interval_covers_the_true_ratio_at_about_its_rate() -> None:
    """Runs of 10 rounds whose true ratio is 0.5: the 95% interval holds it in about 95%
    of them (a percentile bootstrap of 10 rounds runs a little under)."""
    trials = 200
    covered = 0
    for trial in range(trials):
        mine, theirs = _pair(0.5, calls=50, seed=trial)
        estimate = ratio_estimate(mine, theirs, "median")
        covered += estimate.low <= 0.5 <= estimate.high
    assert 0.85 <= covered / trials <= 0.99


def test_interleave_rotates_the_sides() -> None:
    order: list[str] = []
    flat = interleave({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, 3, 2)
    assert order == ["a", "a", "b", "b", "b", "b", "a", "a", "a", "a", "b", "b"]
    assert {name: len(samples) for name, samples in flat.items()} == {"a": 6, "b": 6}
