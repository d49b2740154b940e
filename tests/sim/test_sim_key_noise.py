"""A point's gauge keys shrunk toward the run's mean by how far the gauges tell points
apart (:class:`pushkv.fit.measure_connector.KeyNoise`): the estimator's closed forms,
its limits, and that it recovers a known drift and noise."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pushkv.fit.cpu_profile import MeasurementError
from pushkv.fit.measure_connector import MIN_GAUGES, KeyNoise, key_noise, shrink_keys


def test_a_steady_drift_is_kept_and_noise_alone_is_shrunk_away() -> None:
    # 0, 1, 2, 3, 4: variance (n^2 - 1) / 12 = 2, successive differences all 1
    drift = KeyNoise([0.0, 1.0, 2.0, 3.0, 4.0])
    assert drift.mean == pytest.approx(2.0)
    assert drift.noise_var == pytest.approx(0.5)
    assert drift.drift_var == pytest.approx(1.5)
    assert drift.weight(2) == pytest.approx(1.5 / (1.5 + 0.25))
    assert drift.shrink(4.0, 2) == pytest.approx(2.0 + 2.0 * 1.5 / 1.75)
    # 0, 1, 0, 1, ...: variance 1/4, successive differences all 1 -> nothing but noise
    noise = KeyNoise([0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    assert noise.drift_var == 0.0 and noise.weight(2) == 0.0
    assert noise.shrink(1.0, 2) == pytest.approx(0.5)
    # gauges that agree: nothing to shrink, a point keeps its own
    same = KeyNoise([3.0, 3.0, 3.0])
    assert same.weight(2) == 1.0 and same.shrink(3.0, 2) == 3.0


def test_more_gauges_a_point_keep_more_of_its_own() -> None:
    k = KeyNoise([0.0, 1.0, 2.0, 3.0, 4.0])  # drift 1.5, noise 0.5
    assert k.weight(1) == pytest.approx(1.5 / 2.0)
    assert k.weight(4) == pytest.approx(1.5 / 1.625)
    assert k.weight(1) < k.weight(2) < k.weight(4) < 1.0


def test_too_few_or_broken_gauges_are_refused_in_a_line() -> None:
    with pytest.raises(MeasurementError, match=f"{MIN_GAUGES} gauges"):
        KeyNoise([1.0, 2.0])
    with pytest.raises(MeasurementError, match="not finite"):
        KeyNoise([1.0, math.nan, 2.0])


def test_the_estimates_recover_a_known_drift_and_noise() -> None:
    """Gauges on a slow sine (the machine's speed over a run, drift variance A^2/2) plus
    independent noise of variance s^2: the estimator finds both."""
    rng = np.random.default_rng(7)
    n, amplitude, sd = 4000, 2.0, 1.0
    drift = amplitude * np.sin(np.linspace(0.0, 6 * math.pi, n))
    k = KeyNoise(list(drift + rng.normal(0.0, sd, n)))
    assert k.noise_var == pytest.approx(sd**2, rel=0.08)
    assert k.drift_var == pytest.approx(amplitude**2 / 2, rel=0.08)
    pure = KeyNoise(list(rng.normal(5.0, sd, n)))
    assert pure.weight(2) < 0.1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3), min_size=MIN_GAUGES, max_size=30),
       st.floats(-1e3, 1e3), st.integers(1, 8))
def test_a_shrunk_key_lies_between_its_own_value_and_the_mean(
        xs: list[float], value: float, gauges: int) -> None:
    k = KeyNoise(xs)
    w = k.weight(gauges)
    assert 0.0 <= w <= 1.0 and k.drift_var >= 0.0 and k.noise_var >= 0.0
    got = k.shrink(value, gauges)
    lo, hi = min(value, k.mean), max(value, k.mean)
    assert lo - 1e-9 * (1 + abs(lo)) <= got <= hi + 1e-9 * (1 + abs(hi))


def test_keys_shrink_only_where_enough_gauges_hold_them() -> None:
    gauges = [{"prefill": {"ingest_s": v}, "decode": {"return_s": 1.0}} for v in
              (0.001, 0.003, 0.001, 0.003)]
    gauges[0]["network"] = {"notify_wait_s": 0.002}  # one gauge only: no estimate
    noise = key_noise(gauges)
    assert set(noise) == {("prefill", "ingest_s"), ("decode", "return_s")}
    point = {"prefill": {"ingest_s": 0.003}, "decode": {"return_s": 1.0},
             "network": {"notify_wait_s": 0.009}}
    got = shrink_keys(point, noise)
    # 0.001, 0.003, ... alternate: noise alone, so the point gets the mean
    assert got["prefill"]["ingest_s"] == pytest.approx(0.002)
    assert got["decode"]["return_s"] == 1.0
    assert got["network"]["notify_wait_s"] == 0.009  # kept as measured
    assert point["prefill"]["ingest_s"] == 0.003  # a copy: the input is unchanged
    assert key_noise(gauges[:2]) == {}
