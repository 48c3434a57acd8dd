"""Stop rules (spec ``controls.stop``): a running job that wastes compute is
paused or failed, with the figures the rule acted on.

Three rules, each off unless its field is set:

* **Goodput floor**: the share of the last ``window_s`` seconds that was
  useful (`client.badput`: recovery, start-up, checkpoint stalls and redone
  steps are not) is below ``goodput_floor``.
* **Cost ceiling**: the money spent over the last ``window_s`` (node-hours
  held, spares included, times ``price_per_node_hour``) divided by the steps
  the job advanced in it is above ``cost_per_step_ceiling``. A window in
  which the job did not advance is left to the no-progress rule.
* **No progress**: no step was completed for ``no_progress_s`` seconds (a
  step counts when the job's step goes up, a step redone after a rewind
  included).

When a rule is crossed the job is paused (``action: pause``, the default;
`resume` starts it again) or failed (``action: fail``), in one change whose
reason, kept as the job's message and its generation event (kind CONTROL for
a pause, FINISH for a failure), names the rule and its figures.

What is watched: only a RUNNING job. A job that waits (for members, PENDING)
or is PAUSED is not, and its samples are dropped, so the time it waited is
never judged and, after it runs again, every rule starts afresh. The goodput
and cost windows begin at the first step completed after the job started
running (start-up is not judged), and a verdict needs a full window of
samples: a rule never fires in a job's first window. The no-progress clock
starts when the job is first seen running. The samples live in the leader's
memory: a new leader starts every rule afresh (a stop comes up to one
window, or ``no_progress_s``, later than it would have). Figures are the
leader's: the running generation's tail counts as useful until a failure
ends it (`service.jobmetrics`), so a failure is seen at its detection.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from springback.client import badput
from springback.v1 import job_service_pb2 as js
from springback.v1 import types_pb2 as pb

CHECK_EVERY_S = 1.0
"""A job's rules are evaluated at most this often (each evaluation reads the
job's history from etcd)."""


@dataclass
class _Sample:
    at: float  # wall time (the clock badput's figures use)
    useful_s: float  # the job's useful seconds so far
    cost: float  # the job's cost so far (0 without a price)
    step: int


@dataclass
class _Watch:
    """One running stretch of a job: from when it was seen RUNNING until it stops."""

    started_at: float
    last_step: int
    progress_at: float  # when the job's step last went up (or the stretch began)
    samples: deque[_Sample] = field(default_factory=deque)


def enabled(job: pb.Job) -> bool:
    """Whether any stop rule of `job` is on."""
    stop = job.spec.controls.stop
    return bool(stop.goodput_floor or stop.cost_per_step_ceiling or stop.no_progress_s)


class StopRules:
    """The leader's samples of every watched job, and the rules' verdicts
    (pure: no I/O, nothing raised for well-formed messages)."""

    def __init__(self) -> None:
        self._watches: dict[str, _Watch] = {}
        self._checked: dict[str, float] = {}  # job id -> when its rules were last evaluated

    def forget(self, job_id: str | None = None) -> None:
        """Drops the samples of job `job_id` (deleted), or of every job (None:
        on a leadership change)."""
        if job_id is None:
            self._watches.clear()
            self._checked.clear()
        else:
            self._watches.pop(job_id, None)
            self._checked.pop(job_id, None)

    def due(self, job: pb.Job, now: float) -> bool:
        """Whether `job`'s rules should be evaluated now (on, and not
        evaluated in the last `CHECK_EVERY_S`). A job that is not running
        loses its samples here, without a history read."""
        if not enabled(job) or job.status.state != pb.JOB_STATE_RUNNING:
            self._watches.pop(job.id, None)
            self._checked.pop(job.id, None)
            return False
        if now - self._checked.get(job.id, -CHECK_EVERY_S) < CHECK_EVERY_S:
            return False
        self._checked[job.id] = now
        return True

    def verdict(self, job: pb.Job, events: list[js.GenerationEvent], now: float) -> str | None:
        """The first crossed rule of a RUNNING `job` (its `events`: the job's
        history, oldest first), as "what was seen (the field)"; None while
        none is crossed or a window is not yet full."""
        stop = job.spec.controls.stop
        step = job.status.step
        watch = self._watches.get(job.id)
        if watch is None:
            watch = self._watches[job.id] = _Watch(started_at=now, last_step=step,
                                                   progress_at=now)
        stepped = step > watch.last_step
        if stepped:
            watch.progress_at = now
        watch.last_step = step
        if stop.no_progress_s and now - watch.progress_at >= stop.no_progress_s:
            since = "since it started running" if watch.progress_at == watch.started_at \
                else f"since step {step}"
            return (f"no step completed for {now - watch.progress_at:.0f} s ({since}), the "
                    f"limit is {stop.no_progress_s} s (controls.stop.no_progress_s)")
        if not (stop.goodput_floor or stop.cost_per_step_ceiling):
            return None
        if not watch.samples and not stepped:
            return None  # the windows begin at the first step of this stretch
        rows = badput.per_generation(job, events, now)
        useful = sum(causes["useful"] for _, _, causes in rows)
        cost = badput.cost(job, rows)["cost"] or 0.0
        watch.samples.append(_Sample(at=now, useful_s=useful, cost=cost, step=step))
        while len(watch.samples) > 1 and watch.samples[1].at <= now - stop.window_s:
            watch.samples.popleft()
        first = watch.samples[0]
        span = now - first.at
        if span < stop.window_s:
            return None  # the first window is not full yet
        ratio = min(max((useful - first.useful_s) / span, 0.0), 1.0)
        if stop.goodput_floor and ratio < stop.goodput_floor:
            return (f"goodput {ratio * 100:.1f} % over the last {span:.0f} s is below the "
                    f"floor {stop.goodput_floor * 100:.1f} % (controls.stop.goodput_floor)")
        steps = step - first.step
        if stop.cost_per_step_ceiling and steps > 0:
            per_step = (cost - first.cost) / steps
            if per_step > stop.cost_per_step_ceiling:
                return (f"cost per useful step {per_step:.4g} over the last {span:.0f} s "
                        f"({cost - first.cost:.4g} for {steps} steps) is above the ceiling "
                        f"{stop.cost_per_step_ceiling:.4g} (controls.stop.cost_per_step_ceiling)")
        return None
