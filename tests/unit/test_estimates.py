"""The online estimates every chooser and budget reads: the running average's seed and robust
start, the linear fit's fixed part and its fallback to a cost per unit alone."""

from __future__ import annotations

import pytest

from specserve.estimates import LinearFit, RunningAverage


def test_a_running_average_is_a_mean_then_a_moving_average_and_a_seed_stands_in_until_a_sample():
    avg = RunningAverage(horizon=2)
    avg.seed(5.0, weight=3)
    assert (avg.value, avg.count, avg.provisional) == (5.0, 3, True)
    avg.add(1.0)
    assert (avg.value, avg.provisional) == (1.0, False)  # the first sample replaces the seed
    avg.add(3.0)
    assert avg.value == pytest.approx(2.0)
    avg.add(4.0)  # past the horizon: halfway towards each new sample
    assert avg.value == pytest.approx(3.0)


def test_a_robust_average_starts_from_the_median_and_clips_stalls():
    avg = RunningAverage(horizon=3, robust=True)
    for x in (1.0, 100.0, 1.2):
        avg.add(x)
    assert avg.value == pytest.approx(1.2)
    avg.add(1000.0)  # clipped to twice the estimate
    assert avg.value == pytest.approx(1.2 + (2.4 - 1.2) / 3)


def test_a_linear_fit_finds_the_fixed_part_and_falls_back_to_per_unit_alone():
    fit = LinearFit(window=4)
    assert fit.slope is None
    fit.add(10, 0.5)
    assert (fit.slope, fit.intercept) == (pytest.approx(0.05), 0.0)  # one size: per unit alone
    fit.add(30, 0.9)
    assert (fit.slope, fit.intercept) == (pytest.approx(0.02), pytest.approx(0.3))
    fit.add(50, 0.1)  # a decreasing cost is noise: per unit alone again
    assert fit.intercept == 0.0 and fit.slope == pytest.approx(1.5 / 90)
