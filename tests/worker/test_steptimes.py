"""Rank 0's step-time percentiles (worker/train/steptimes.py)."""

from __future__ import annotations

import pytest

from springback.worker.train.steptimes import STEP_WINDOW, StepTimes

pytestmark = pytest.mark.timeout(10)


def test_percentiles_are_the_nearest_rank_of_the_step_gaps():
    times = StepTimes()
    ends = [0.0]
    for gap in [0.1] * 89 + [0.5] * 10 + [2.0]:  # 100 steps after the first
        ends.append(ends[-1] + gap)
    for t in ends:
        times.step_ended(t)
    p50, p90, p99 = times.quantiles()
    assert p50 == pytest.approx(0.1) and p90 == pytest.approx(0.5) and p99 == pytest.approx(0.5)
    times.step_ended(ends[-1] + 3.0)  # one more slow step: now 2 of 101 are >= 2 s
    assert times.quantiles()[2] == pytest.approx(2.0)


def test_the_first_step_is_no_step_time_and_the_window_is_bounded():
    times = StepTimes()
    times.step_ended(100.0)  # the generation's first step: warm-up, not a step time
    assert times.quantiles() == (0.0, 0.0, 0.0)
    t = 100.0
    for gap in [10.0] * 11 + [1.0] * (STEP_WINDOW - 11):
        t += gap
        times.step_ended(t)
    assert times.quantiles()[2] == pytest.approx(10.0)  # 11 of the window's 1,024: over 1 %
    times.step_ended(t + 1.0)
    assert times.quantiles()[2] == pytest.approx(1.0)  # the first left the window: 10 are not
