"""The straggler policy (spec ``controls.straggler``, issue 46): a member
that sets every rank's step time is set aside when the job is faster
without it.

The policy is pure: the leader hands `Stragglers.observe` each step report's per-member
timing (`JobStatus.member_timing`, medians over the generation's last steps,
worker/train/ranktiming.py) and gets back a decision to act on
(`Coordinator` writes it as a change of kind CONTROL); nothing here reads
etcd or a clock of its own.

* **Slow**: a member's compute median is above ``factor`` times the median
  of the other members' compute medians, each over at least `MIN_STEPS`
  steps (a generation's first steps are not judged).
* **For the window**: every report since the first that found it slow
  found it slow, over at least ``window_steps`` steps. One report that finds
  it not slow starts its window afresh, and so does every new generation
  (its timing starts empty). The medians trail the slowdown by up to half
  their own window (a median moves once half its steps are slow).
* **Faster without it** (the cost model): in synchronous training the step
  waits for the slowest compute, so the straggler costs, per step, its
  compute median less what the step's compute would be without it: the
  others' median when a hot spare takes its place, or, with no spare, that
  median times ``world / (world - its ranks)`` (the global batch stays
  constant, so the others compute more each). That, times the steps left
  (``max_steps`` less the step, at most ``horizon_steps``), is the saving;
  it is set aside only when the saving is above the cost of a generation
  change: ``change_cost_s`` when the spec sets it, else the median
  recovery of the job's last `MEASURED_CHANGES` changes after its start
  (`GenerationEvent.recovery`: from the last step before a change to the
  first step after it), else `DEFAULT_CHANGE_COST_S`. Both figures are in
  the event's reason.
* **Not below min_workers**: with no spare and ``min_workers`` members
  active it is left in (the job would wait, which is slower still).
* **Set aside, then back**: the member is planned as a spare
  (`set_aside`, `JobStatus.set_aside`, durable: a new leader keeps it) for
  ``cooldown_s``, doubled each further time it is set aside, so a node that
  stays slow is not flapped; after that `returns` names it and the leader
  plans it as any other member again (a spare, or back in a smaller world).

One member at a time: a decision changes the generation, whose timing
starts empty. Not built: slow *links* (a pair's collective time).

Its leader side (not pure) is `core/setaside.py`: called after each step
report that carried timing, it reads the job only when a decision is due and
writes it through `Coordinator.change_with_retry`.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from springback.v1 import job_service_pb2 as js
from springback.v1 import types_pb2 as pb

MIN_STEPS = 10
"""Steps a member's medians must cover before it is judged."""
DEFAULT_CHANGE_COST_S = 30.0
"""A generation change's cost when the spec sets none and the job has no
measured change yet."""
MEASURED_CHANGES = 5
"""The newest changes whose recoveries the measured cost is the median of."""
KEPT_ENTRIES = 64
"""Most `SetAside` entries a job keeps (returned ones go first): member
input is bounded before it reaches etcd."""


@dataclass(frozen=True)
class Eviction:
    """A straggler to set aside, with the evidence and the cost model's figures."""

    member_id: str
    compute_s: float
    median_s: float
    """The median of the other members' compute medians."""
    factor: float
    first_step: int
    step: int
    window_steps: int
    gain_s: float
    """Seconds per step the job saves without it."""
    steps_left: int
    change_cost_s: float
    cost_from: str
    spare: bool
    """A hot spare takes its place (else the world shrinks)."""

    @property
    def saving_s(self) -> float:
        return self.gain_s * self.steps_left

    def reason(self, cooldown_s: float) -> str:
        instead = "a hot spare takes its place" if self.spare else "a smaller world"
        return (
            f"controls.straggler: set aside {self.member_id}: compute p50 "
            f"{self.compute_s * 1e3:.1f} ms is above {self.factor:g} x the others' median "
            f"{self.median_s * 1e3:.1f} ms on every report over steps {self.first_step}-"
            f"{self.step} (window {self.window_steps} steps); without it the job saves "
            f"{self.gain_s * 1e3:.1f} ms x {self.steps_left} steps left = {self.saving_s:.1f} s, "
            f"above a generation change's {self.change_cost_s:.1f} s ({self.cost_from}); "
            f"{instead}; it may return in {cooldown_s:g} s")


def active(status: pb.JobStatus) -> set[str]:
    """The members set aside now (planned as spares)."""
    return {e.member_id for e in status.set_aside if not e.returned}


def set_aside(status: pb.JobStatus, member_id: str, now_s: float, cooldown_s: float) -> float:
    """Records `member_id` as set aside from `now_s` (unix seconds) for
    `cooldown_s` doubled once per earlier time; returns that cool-down."""
    entry = next((e for e in status.set_aside if e.member_id == member_id), None)
    if entry is None:
        entry = status.set_aside.add(member_id=member_id)
    times = entry.times
    cooldown = cooldown_s * 2 ** min(times, 16)
    entry.times, entry.returned = times + 1, False
    entry.until.FromNanoseconds(int((now_s + cooldown) * 1e9))
    while len(status.set_aside) > KEPT_ENTRIES:
        oldest = next((i for i, e in enumerate(status.set_aside) if e.returned), 0)
        del status.set_aside[oldest]
    return cooldown


def returns(status: pb.JobStatus, now_s: float) -> list[str]:
    """The members set aside whose cool-down is over at `now_s`."""
    return [e.member_id for e in status.set_aside
            if not e.returned and e.until.ToNanoseconds() / 1e9 <= now_s]


def mark_returned(status: pb.JobStatus, member_ids: Iterable[str]) -> None:
    back = set(member_ids)
    for e in status.set_aside:
        if e.member_id in back:
            e.returned = True


def change_cost(policy: pb.StragglerPolicy,
                events: Sequence[js.GenerationEvent]) -> tuple[float, str]:
    """The cost of a generation change and where it comes from (module docstring)."""
    if policy.change_cost_s:
        return policy.change_cost_s, "controls.straggler.change_cost_s"
    measured = [e.recovery.ToNanoseconds() / 1e9 for e in events
                if e.kind != js.CHANGE_KIND_START and e.HasField("recovery")][-MEASURED_CHANGES:]
    if measured:
        return statistics.median(measured), f"median recovery of the last {len(measured)} changes"
    return DEFAULT_CHANGE_COST_S, "default: no change measured yet"


class Stragglers:
    """The policy's evidence in the leader's memory: per job, its generation
    and, per member, the step of the first report of its current slow run."""

    def __init__(self) -> None:
        self._slow: dict[str, tuple[int, dict[str, int]]] = {}
        self.specs: dict[str, pb.JobSpec] = {}
        """Each job's spec, read once per leadership (no request changes it)."""
        self.next_return: dict[str, float] = {}
        """Per job, the earliest end of a cool-down (unix seconds), if any."""

    def forget(self, job_id: str | None = None) -> None:
        for kept in (self._slow, self.specs, self.next_return):
            if job_id is None:
                kept.clear()
            else:
                kept.pop(job_id, None)

    def learn(self, job: pb.Job) -> None:
        """Keeps `job`'s spec and the end of its earliest cool-down."""
        self.specs[job.id] = job.spec
        self.note_returns(job.id, job.status)

    def note_returns(self, job_id: str, status: pb.JobStatus) -> None:
        ends = [e.until.ToNanoseconds() / 1e9 for e in status.set_aside if not e.returned]
        if ends:
            self.next_return[job_id] = min(ends)
        else:
            self.next_return.pop(job_id, None)

    def due(self, policy: pb.StragglerPolicy, job_id: str, generation: int, step: int,
            timing: Sequence[pb.MemberTiming]) -> str | None:
        """Notes one report's timing; returns the member whose slow run now
        spans the window (the slowest such), for `judge` to weigh."""
        if not policy.enabled:
            return None
        gen, slow = self._slow.get(job_id, (0, {}))
        if gen != generation:
            gen, slow = generation, {}
            self._slow[job_id] = (gen, slow)
        judged = [t for t in timing if t.num_steps >= min(MIN_STEPS, policy.window_steps)]
        if len(judged) < 2 or len(judged) < len(timing):
            return None
        now_slow = []
        for t in judged:
            median = statistics.median(o.compute_p50_s for o in judged if o is not t)
            if t.compute_p50_s > policy.factor * median:
                slow.setdefault(t.member_id, step)
                now_slow.append(t)
            else:
                slow.pop(t.member_id, None)
        ripe = [t for t in now_slow if step - slow[t.member_id] >= policy.window_steps]
        if not ripe:
            return None
        return max(ripe, key=lambda t: t.compute_p50_s).member_id

    def judge(self, job: pb.Job, member_id: str, step: int, timing: Sequence[pb.MemberTiming],
              ranks: dict[str, int], spares: Sequence[str],
              events: Sequence[js.GenerationEvent]) -> Eviction | str:
        """The eviction of `member_id` (from `due`), or why it stays: the
        cost model (module docstring). `ranks`: each active member's local
        ranks; `spares`: live spares not set aside."""
        policy = job.spec.controls.straggler
        by_id = {t.member_id: t for t in timing}
        me = by_id[member_id]
        median = statistics.median(t.compute_p50_s for t in timing if t.member_id != member_id)
        world = sum(ranks.values())
        spare = bool(spares)
        if not spare and len(ranks) - 1 < max(job.spec.min_workers, 1):
            return (f"{member_id} stays: without a spare the job would have "
                    f"{len(ranks) - 1} members, below min_workers {job.spec.min_workers}")
        mine = ranks.get(member_id, 1)
        after = median if spare else median * world / max(world - mine, 1)
        gain = me.compute_p50_s - after
        steps_left = max(job.spec.max_steps - step, 0)
        if policy.horizon_steps:
            steps_left = min(steps_left, policy.horizon_steps)
        cost, cost_from = change_cost(policy, events)
        gen, slow = self._slow.get(job.id, (0, {}))
        eviction = Eviction(
            member_id=member_id, compute_s=me.compute_p50_s, median_s=median,
            factor=policy.factor, first_step=slow.get(member_id, step), step=step,
            window_steps=policy.window_steps, gain_s=gain, steps_left=steps_left,
            change_cost_s=cost, cost_from=cost_from, spare=spare)
        if gain <= 0 or eviction.saving_s <= cost:
            slow.pop(member_id, None)  # weighed: a new window before it is weighed again
            return (f"{member_id} stays: without it the job saves {max(gain, 0) * 1e3:.1f} ms x "
                    f"{steps_left} steps = {max(eviction.saving_s, 0):.1f} s, not above a "
                    f"generation change's {cost:.1f} s ({cost_from})")
        return eviction
