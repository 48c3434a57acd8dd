"""`checkpoint.every_steps: auto`: the checkpoint interval from Young-Daly.

The interval that minimises the expected time lost to checkpoints plus the
work redone after a failure is about ``sqrt(2 * C * MTBF)`` seconds, with ``C``
the time one checkpoint blocks training and ``MTBF`` the mean time between
failures. The coordinator chooses it for each RUN generation (`apply`, from
`replan`), so it is re-evaluated whenever a failure makes a new generation,
and tells the ranks through the plan's ``spec.checkpoint.every_steps`` (the
field ranks read today, worker/train/checkpointing.py).

Which failures count: a checkpoint insures only against *rollbacks*, the
failures whose recovery went back to a checkpoint (or lost the steps:
``steps_redone > 0`` at the next generation's start). A failure the survivors
recovered from their own memory (a hand-over, a reshard, a peer copy) redoes
nothing whatever the interval, so counting it would checkpoint more often for
no gain. So ``MTBF`` here is the mean time between rollbacks: the job's
running time divided by its rollbacks, or, while none has been seen, the
spec's ``mtbf_prior_s`` plus the running time (the prior, lengthened by the
time the job has run without one; all failures seen so far are reported with
it). ``C`` is the stall rank 0 last measured, and the step time the
coordinator measured between step reports. Until both are measured the
interval is `DEFAULT_INITIAL_STEPS` (a generation's interval stays as chosen
until the next generation: a job that never fails keeps its first choice).
The result is always within ``[min_every_steps, max_every_steps]``. The
measurements are the leader's memory: a new leader starts from the prior.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from springback.v1 import types_pb2 as pb

DEFAULT_MTBF_PRIOR_S = 3600
"""checkpoint.mtbf_prior_s when the spec leaves it 0: one failure an hour."""
DEFAULT_MIN_EVERY_STEPS = 1
DEFAULT_INITIAL_STEPS = 100
"""The interval before a checkpoint cost and a step time are measured
(within the spec's bounds)."""


def young_daly_s(cost_s: float, mtbf_s: float) -> float:
    """Seconds between checkpoints: sqrt(2 * cost * MTBF). Raises ValueError
    for a negative figure."""
    if cost_s < 0 or mtbf_s < 0:
        raise ValueError(f"cost_s and mtbf_s must not be negative, got {cost_s}, {mtbf_s}")
    return math.sqrt(2.0 * cost_s * mtbf_s)


def bounds(spec: pb.JobSpec) -> tuple[int, int]:
    """[min_every_steps, max_every_steps] of `spec` with its defaults."""
    lo = spec.checkpoint.min_every_steps or DEFAULT_MIN_EVERY_STEPS
    hi = spec.checkpoint.max_every_steps or max(int(spec.max_steps), lo)
    return lo, hi


@dataclass(frozen=True)
class Observed:
    """What the coordinator measured of a job (0.0: not measured yet)."""

    running_s: float = 0.0
    failures: int = 0
    rollbacks: int = 0
    cost_s: float = 0.0
    step_s: float = 0.0


def choose(spec: pb.JobSpec, seen: Observed) -> pb.CheckpointInterval:
    """The interval (in steps) and the figures it came from. Pure; never raises
    for a validated spec."""
    lo, hi = bounds(spec)
    prior = float(spec.checkpoint.mtbf_prior_s or DEFAULT_MTBF_PRIOR_S)
    if seen.rollbacks > 0 and seen.running_s > 0:
        mtbf = seen.running_s / seen.rollbacks
        where = (f"time between rollbacks observed ({seen.rollbacks} rollbacks in "
                 f"{seen.failures} failures)")
    else:
        mtbf = prior + seen.running_s
        where = (f"no rollback yet ({seen.failures} failures, all recovered live): the prior "
                 f"{prior:.4g} s + {seen.running_s:.4g} s run")
    out = pb.CheckpointInterval(mtbf_s=mtbf, failures=seen.failures, rollbacks=seen.rollbacks,
                                cost_s=seen.cost_s, step_s=seen.step_s)
    if seen.cost_s <= 0 or seen.step_s <= 0:
        out.every_steps = max(lo, min(hi, DEFAULT_INITIAL_STEPS))
        out.basis = (f"initial {DEFAULT_INITIAL_STEPS} within [{lo}, {hi}]: checkpoint cost "
                     "or step time not measured yet")
        return out
    interval_s = young_daly_s(seen.cost_s, mtbf)
    steps = max(lo, min(hi, int(round(interval_s / seen.step_s)) or 1))
    out.every_steps = steps
    out.basis = (f"Young-Daly sqrt(2 x {seen.cost_s:.3g} s x {mtbf:.4g} s) = {interval_s:.4g} s"
                 f" / {seen.step_s:.3g} s per step, within [{lo}, {hi}]; {where}")
    return out


def apply(plan: pb.Plan, seen: Observed) -> pb.CheckpointInterval | None:
    """Sets a RUN plan's ``spec.checkpoint.every_steps`` for an auto job;
    returns what was chosen (None: not an auto job or not a RUN plan, the plan
    is unchanged)."""
    if not plan.spec.checkpoint.auto_interval or plan.action != pb.PLAN_ACTION_RUN:
        return None
    chosen = choose(plan.spec, seen)
    plan.spec.checkpoint.every_steps = chosen.every_steps
    return chosen
