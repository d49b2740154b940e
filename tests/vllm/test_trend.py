"""The soak's trend test (pushkv.vllm.trend) against brute force and closed forms."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pushkv.vllm.trend import mann_kendall_s, p_rising, theil_sen, trend


def brute_p(values: list[float]) -> float:
    """P(S >= s) over every order of the values, each equally likely."""
    s = mann_kendall_s(values)
    perms = list(itertools.permutations(values))
    return sum(mann_kendall_s(list(p)) >= s for p in perms) / len(perms)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-1000, 1000), min_size=2, max_size=7, unique=True))
def test_exact_p_equals_the_share_of_orders_at_least_as_rising(values: list[int]) -> None:
    vals = [float(v) for v in values]
    assert p_rising(vals) == pytest.approx(brute_p(vals))


def test_a_strictly_increasing_series_has_p_one_over_n_factorial() -> None:
    assert p_rising([1.0, 2, 3, 4, 5]) == pytest.approx(1 / math.factorial(5))
    assert trend([float(i) for i in range(10)]).rising


def test_a_decreasing_or_flat_series_is_not_rising() -> None:
    assert p_rising([5.0, 4, 3, 2, 1]) == pytest.approx(1.0)
    flat = trend([3.0] * 8)
    assert not flat.rising and flat.slope == 0.0 and flat.rise == 0.0


def test_noise_around_a_level_is_not_rising_and_a_drift_is() -> None:
    noisy = [638.2, 454.5, 489.9, 622.1, 445.3, 980.9, 509.9, 579.8, 679.6, 480.0]
    assert not trend(noisy).rising
    drift = [v + 60.0 * i for i, v in enumerate(noisy)]
    t = trend(drift)
    assert t.rising and t.slope > 0 and t.rise > 0.5


def test_ties_use_the_tie_corrected_normal_approximation() -> None:
    values = [1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 4.0, 5.0, 5.0]
    p = p_rising(values)
    assert 0.0 < p < 0.01
    assert p_rising([2.0, 2.0, 1.0, 1.0]) > 0.5


def test_theil_sen_ignores_one_outlier() -> None:
    assert theil_sen([1.0, 2.0, 3.0, 100.0, 5.0, 6.0]) == pytest.approx(1.0)


@pytest.mark.parametrize("bad", [[1.0, math.nan], [math.inf, 1.0]])
def test_non_finite_values_are_refused(bad: list[float]) -> None:
    with pytest.raises(ValueError, match="finite"):
        trend(bad)


def test_alpha_outside_zero_one_is_refused() -> None:
    with pytest.raises(ValueError, match="alpha"):
        trend([1.0, 2.0], alpha=1.5)


def test_short_series_are_never_rising() -> None:
    assert not trend([]).rising and not trend([1.0]).rising
