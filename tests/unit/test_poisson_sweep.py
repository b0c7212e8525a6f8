"""The Poisson sweep's decision rule (benchmarks/poisson.py) on made-up measurements: which rate passes, which rate
comes next, and that the sweep ends within its steps and its seconds."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from benchmarks.poisson import Trial, best_rate, next_rate, passes, sweep

LIMIT = 15.0


def server(capacity: float) -> Callable[[float], Trial]:
    """A made-up server: p99 5 ms below ``capacity`` requests/s, 50 ms above."""

    def measure(rate: float) -> Trial:
        return Trial(rate=rate, p99_ms=5.0 if rate <= capacity else 50.0)

    return measure


def test_a_rate_passes_only_with_p99_within_the_limit_and_no_errors() -> None:
    assert passes(Trial(rate=100, p99_ms=15.0), LIMIT)
    assert not passes(Trial(rate=100, p99_ms=15.01), LIMIT)
    assert not passes(Trial(rate=100, p99_ms=1.0, errors=1), LIMIT)
    assert not passes(Trial(rate=100, p99_ms=None, errors=0), LIMIT)  # nothing answered


def test_rates_rise_by_the_growth_factor_while_every_rate_passes() -> None:
    assert next_rate([], LIMIT, start=100) == 100
    trials = [Trial(rate=100, p99_ms=3), Trial(rate=200, p99_ms=8)]
    assert next_rate(trials, LIMIT, start=100, growth=2) == 400


def test_after_a_failure_the_next_rate_bisects_between_the_last_pass_and_the_first_failure() -> None:
    trials = [Trial(rate=100, p99_ms=3), Trial(rate=200, p99_ms=8), Trial(rate=400, p99_ms=40)]
    assert next_rate(trials, LIMIT, start=100) == 300
    trials.append(Trial(rate=300, p99_ms=12))
    assert next_rate(trials, LIMIT, start=100) == 350
    assert best_rate(trials, LIMIT) == 300


def test_a_pass_above_a_failure_is_noise_not_capacity() -> None:
    trials = [Trial(rate=100, p99_ms=3), Trial(rate=200, p99_ms=30), Trial(rate=300, p99_ms=10)]
    assert best_rate(trials, LIMIT) == 100
    assert next_rate(trials, LIMIT, start=100) == 150


def test_a_failure_at_the_first_rate_bisects_down_towards_zero() -> None:
    trials = [Trial(rate=100, p99_ms=30)]
    assert best_rate(trials, LIMIT) is None
    assert next_rate(trials, LIMIT, start=100) == 50


def test_the_sweep_is_done_within_the_resolution_or_below_the_minimum_rate_or_after_its_steps() -> None:
    close = [Trial(rate=300, p99_ms=5), Trial(rate=320, p99_ms=20)]
    assert next_rate(close, LIMIT, start=300, resolution=0.1) is None
    assert next_rate([Trial(rate=0.8, p99_ms=20)], LIMIT, start=0.8, min_rate=1.0) is None
    passing = [Trial(rate=float(r), p99_ms=1) for r in (1, 2, 4)]
    assert next_rate(passing, LIMIT, start=1, max_steps=3) is None


@pytest.mark.parametrize("bad", [{"growth": 1.0}, {"resolution": 0.0}, {"resolution": 1.0}, {"start": 0.0}])
def test_settings_that_would_never_end_are_refused(bad: dict[str, float]) -> None:
    settings: dict[str, float] = {"start": 10.0, **bad}
    with pytest.raises(ValueError, match="growth must be > 1"):
        next_rate([], LIMIT, **settings)  # type: ignore[arg-type]


def test_the_sweep_finds_a_made_up_capacity_within_its_resolution() -> None:
    result = sweep(server(1000.0), LIMIT, start=100, seconds_per_rate=1, budget_seconds=1e9, resolution=0.05)
    assert result["stopped"] == "done"
    assert 0.95 * 1000 <= result["best_rate"] <= 1000
    rates = [t["rate"] for t in result["trials"]]
    assert rates[:5] == [100, 200, 400, 800, 1600]  # rising, then bisecting between 800 and 1600


def test_the_sweep_stops_at_its_step_bound_and_its_time_budget() -> None:
    assert len(sweep(server(1e6), LIMIT, start=1, seconds_per_rate=1, budget_seconds=1e9, max_steps=4)["trials"]) == 4
    now = [0.0]

    def measure(rate: float) -> Trial:
        now[0] += 3.0  # each trial takes 3 made-up seconds
        return Trial(rate=rate, p99_ms=1.0)

    result = sweep(measure, LIMIT, start=1, seconds_per_rate=3, budget_seconds=10, clock=lambda: now[0])
    assert result["stopped"] == "budget"
    assert len(result["trials"]) == 3  # a fourth would end at 12 s
    assert result["best_rate"] == 4
