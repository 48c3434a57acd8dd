"""Rank 0's step times in a generation, as percentiles (issue 30: distributions,
not means).

A step's time is from the previous step's end to its own, both as the step
boundary recorded them (`boundary.Agreed.ended_t`), so the first step of a
generation (warm-up, the build, the state hand-over) is not one. The window
is the generation's last `STEP_WINDOW` steps: a bounded cost per step (one
sort of at most that many floats) and a tail that follows what the job does
now rather than what it did an hour ago.
"""

from __future__ import annotations

import collections
import math

STEP_WINDOW = 1024


class StepTimes:
    """Step times of one generation; `quantiles` of its last `STEP_WINDOW`."""

    def __init__(self) -> None:
        self._times: collections.deque[float] = collections.deque(maxlen=STEP_WINDOW)
        self._last_end: float | None = None

    def step_ended(self, ended_t: float) -> None:
        if self._last_end is not None and ended_t >= self._last_end:
            self._times.append(ended_t - self._last_end)
        self._last_end = ended_t

    def quantiles(self) -> tuple[float, float, float]:
        """(p50, p90, p99) in seconds, nearest-rank; zeros with fewer than 2 steps."""
        if len(self._times) < 2:
            return 0.0, 0.0, 0.0
        ordered = sorted(self._times)
        n = len(ordered)

        def rank(q: float) -> float:  # the smallest time with at least q of the times at or below it
            return ordered[min(n - 1, max(0, math.ceil(q * n - 1e-9) - 1))]

        return rank(0.50), rank(0.90), rank(0.99)
