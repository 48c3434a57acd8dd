"""What the coordinator's leader keeps in memory for one job (`JobState`).

Everything here is a cache or a measurement of the leader's own term: none
of it is needed to keep a job, member, generation or commit, which are all
in etcd. On a leadership change (`Coordinator.leadership_changed`) and on a
job's deletion (`Coordinator.delete_job`) a job's `JobState` is dropped
whole, in one place, and a new leader starts each job's afresh; what that
costs is said per field.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from springback.service.policy import planner
from springback.v1 import job_service_pb2 as js
from springback.v1 import types_pb2 as pb

SERIES_POINTS = 2000
"""Newest (time, step, loss) points kept per job for the dashboard's loss curve."""


class Unsettled(NamedTuple):
    """A membership change of the job that the reconcile loop has not planned yet."""

    first_seen: float  # monotonic: the first change not yet planned
    fingerprint: tuple[int, int]  # members' (count, newest revision) last seen
    last_change: float  # monotonic: when that fingerprint was first seen


class PlanView(NamedTuple):
    """What the leader keeps of a job's current plan (it writes every plan)."""

    generation: int
    signature: tuple  # planner.signature: action and rank assignment
    members: frozenset[str]  # active member ids


class Measures:
    """The leader's measurements of one job, for `ckptinterval` (0.0: none yet)."""

    def __init__(self) -> None:
        self.failures = 0  # generations made for a node loss or a rank failure
        self.rollbacks = 0  # generation starts that redid or lost steps
        self.cost_s = 0.0  # rank 0's newest checkpoint stall
        self.step_s = 0.0  # seconds per step, a moving average of report gaps
        self.last: tuple[int, int, float] | None = None  # (generation, step, when) reported

    def step_reported(self, generation: int, step: int, stall_s: float, now: float) -> None:
        if stall_s > 0:
            self.cost_s = stall_s
        last = self.last
        if last is not None and last[0] == generation and step > last[1]:
            gap = (now - last[2]) / (step - last[1])
            self.step_s = gap if self.step_s <= 0 else 0.7 * self.step_s + 0.3 * gap
        self.last = (generation, step, now)


def _series() -> deque[tuple[float, int, float]]:
    return deque(maxlen=SERIES_POINTS)


@dataclass
class JobState:
    """One job as the leader holds it in memory, beside what etcd holds.

    Lost on a leadership change, and why that is safe:

    * `progress` not yet flushed (`dirty`): at most ``progress_flush_s`` of
      reported steps; the ranks keep reporting and the next report restores it.
    * `series`: the dashboard's loss curve restarts with the new leader.
    * `event`: the last change in words, for watch streams (which a new
      leader serves from its own changes).
    * `plan`, `max_steps`, `fingerprint`: caches of etcd, read again on a miss.
    * `unsettled`: a membership change being waited on is seen again by the
      new leader's reconcile loop, which waits for it afresh.
    * `departures`: a noted why is lost; a member that went unplanned is then
      named "lost ... (liveness timeout)", a node loss.
    * `measures`: the auto checkpoint interval starts again from the spec's prior.
    * `reconcile_error`: the next error is logged once more.
    """

    progress: planner.Progress | None = None  # newest reported step
    dirty: bool = False  # `progress` is not yet in etcd
    series: deque[tuple[float, int, float]] = field(default_factory=_series)
    event: str | None = None  # the last change, in words (None: none since it became leader)
    plan: PlanView | None = None  # what matters of its current plan
    max_steps: int | None = None  # spec.max_steps (fixed at submission)
    # members' (count, newest revision) when last found in line with the plan
    fingerprint: tuple[int, int] | None = None
    unsettled: Unsettled | None = None  # a membership change not yet planned
    reconcile_error: str = ""  # the reconcile error last logged (logged once, counted always)
    measures: Measures = field(default_factory=Measures)  # for `checkpoint.every_steps: auto`
    member_timing: tuple[int, list[pb.MemberTiming]] = (0, [])
    """The newest step report's per-member timing and its generation
    (`JobStatus.member_timing`); a new leader shows none until a report."""
    # member id -> why it went and as what kind, noted before its lease is revoked
    departures: dict[str, tuple[str, js.ChangeKind]] = field(default_factory=dict)
