"""The stop rule for repeated rank failures (a pure policy, kept in leader memory).

A rank that crashes is restarted and the job goes on. A rank that crashes
*again at the same place* — a bad batch, a deterministic OOM, a bug hit at a
fixed step — would loop forever, so the job ends FAILED once
``failures.max_per_step`` generations have broken by rank failures without
the job getting past the step of the first of them, all within
``failures.window_s`` seconds.

Several failure reports of one generation (every rank crashing at once, one
report per agent) count once; agents report a rank's exit for the
generation the rank was in, not their newest plan's. A live rank's break
(state kept) of a generation that never started is not counted there (the
caller's `counted`): it is the consequence of another member's failure (a
crashed or hung peer that never joined the rendezvous). It is counted
apart instead (`record_unstarted`): `UNSTARTED_FACTOR` x ``max_per_step``
generations in a row that could not start end the job FAILED all the same,
so a rendezvous that can never complete is no endless loop.
A store that refuses a restore is no failure at all
(``failures.storage_outage_s``, `membership.Membership.report_failure`). Progress beyond the streak's step, or a gap
longer than the window, starts a new streak. The streaks live in the
leader's memory: a leader change forgets them (the job may then take up to
``max_per_step`` more failures before it is failed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from springback.client.spec import (
    DEFAULT_MAX_PER_STEP,
    DEFAULT_PLAN_WAIT_S,
    DEFAULT_STORAGE_OUTAGE_S,
    DEFAULT_WINDOW_S,
)

__all__ = ["DEFAULT_MAX_PER_STEP", "DEFAULT_PLAN_WAIT_S", "DEFAULT_STORAGE_OUTAGE_S",
           "DEFAULT_WINDOW_S", "FailureStreaks"]


UNSTARTED_FACTOR = 3
"""Generations in a row broken before they started, per ``max_per_step``,
that end the job FAILED (see `FailureStreaks.record_unstarted`)."""


@dataclass
class _Streak:
    step: int
    started_at: float
    generations: set[int] = field(default_factory=set)


class FailureStreaks:
    """Per job: the current streak of failures that made no progress."""

    def __init__(self) -> None:
        self._streaks: dict[str, _Streak] = {}
        self._unstarted: dict[str, set[int]] = {}  # job -> never-started generations broken

    def record(self, job_id: str, *, step: int, generation: int, now: float,
               max_per_step: int, window_s: float, counted: bool = True) -> int:
        """Counts a failure reported at progress `step` in `generation`;
        returns the streak's length (stop the job when >= `max_per_step`).
        With `counted` False only the length is returned."""
        streak = self._streaks.get(job_id)
        if not counted:
            return len(streak.generations) if streak is not None and step <= streak.step else 0
        if streak is None or step > streak.step or now - streak.started_at > window_s:
            streak = self._streaks[job_id] = _Streak(step=step, started_at=now)
        streak.generations.add(generation)
        return len(streak.generations)

    def record_unstarted(self, job_id: str, *, generation: int, newest_start: int) -> int:
        """Counts a live rank's break of `generation`, which never started
        (`newest_start` is the newest generation that did); returns how many
        generations in a row after `newest_start` broke so (stop the job when
        >= `UNSTARTED_FACTOR` x ``max_per_step``: a rendezvous that can never
        complete is a deterministic error, not weather)."""
        broken = self._unstarted.setdefault(job_id, set())
        broken.difference_update({g for g in broken if g <= newest_start})
        broken.add(generation)
        return len(broken)

    def forget(self, job_id: str) -> None:
        self._streaks.pop(job_id, None)
        self._unstarted.pop(job_id, None)
