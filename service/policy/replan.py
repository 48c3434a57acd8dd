"""The replan policy: from what the leader read, the job's next record and plan.

Pure: no I/O, no clock but the timestamps it stamps, no shared state. The
coordinator reads the job, its plan, members and checkpoints, hands them to
`replan`, and writes the `Decision` through its fenced writer (`writer`).
A decision that is never written (a lost compare, leadership gone) changed
nothing.

A new generation is made when the plan's signature (action and rank
assignment, `planner.signature`) changes, or when forced (a rank crashed, an
operator restore); otherwise the plan stays, and only its hot spares may be
updated in place (training is not interrupted).

A planner error (a member record `JoinJob` would have refused, a bug) never
escapes: the job gets a WAIT plan that keeps its state holders and lists every
other live member as a spare, its status message says ``planner error: ...``,
and the error is logged once per job and message. Every live member is thus
planned, so the reconcile loop does not retry the job until its membership
changes, and the other jobs' replans go on.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Collection
from dataclasses import dataclass

from google.protobuf.timestamp_pb2 import Timestamp

from springback.service.policy import ckptinterval, planner, stragglers
from springback.v1 import types_pb2 as pb

log = logging.getLogger(__name__)

RENDEZVOUS_SECRET_BYTES = 16
"""Random bytes of a generation's rendezvous secret (`Plan.rendezvous_secret`): 128 bits."""


def timestamp_now() -> Timestamp:
    ts = Timestamp()
    ts.GetCurrentTime()
    return ts


@dataclass(kw_only=True)
class Inputs:
    """What one replan reads (the job already mutated by the caller)."""

    job: pb.Job
    previous: pb.Plan | None
    previous_signature: tuple | None
    """`planner.signature(previous)`, cached by the leader."""
    members: list[pb.Member]
    checkpoints: list[pb.CheckpointRef]
    """Committed checkpoints, newest first."""
    progress: planner.Progress | None
    """In-memory progress newer than the record, if any."""
    reason: str
    stateless: Collection[str] = ()
    draining: Collection[str] = ()
    force_generation: bool = False
    observed: ckptinterval.Observed = ckptinterval.Observed()
    """What an auto checkpoint interval is chosen from (`ckptinterval`)."""
    ended: bool = False
    """The job had ended (a terminal state) before the caller's mutation: its
    status message, which says why it ended, is kept."""
    paused: bool = False
    """The job was paused before the caller's mutation: while it stays
    paused its status message, which says why it paused (a stop rule's
    figures, the bad steps), is kept; a commit or a member's change that
    lands after the pause does not replace it."""


@dataclass(frozen=True)
class Decision:
    job: pb.Job
    """The job record to write (status rewritten)."""
    plan: pb.Plan
    """The plan made; written when `new_generation`."""
    new_generation: bool
    signature: tuple
    plan_write: pb.Plan | None
    """The plan record to write: the new plan, the previous one with new spares, or None."""
    planning_s: float
    """Seconds spent in the planner (a metric)."""
    interval: pb.CheckpointInterval | None = None
    """The checkpoint interval chosen for the plan (auto jobs' RUN plans only)."""


def _keep_holders(job: pb.Job, members: list[pb.Member], stateless: Collection[str]) -> list[str]:
    live = {m.id for m in members}
    holders = [h for h in job.status.state_holders if h in live and h not in stateless]
    del job.status.state_holders[:]
    job.status.state_holders.extend(holders)
    return holders


def _make_plan(inputs: Inputs, holders: list[str],
               requested: pb.CheckpointRef | None) -> tuple[pb.Plan, float]:
    job, checkpoints = inputs.job, inputs.checkpoints
    started = time.perf_counter()
    plan = planner.make_plan(
        job, inputs.members, inputs.previous,
        progress=inputs.progress or planner.Progress(
            step=job.status.step, samples_consumed=job.status.samples_consumed,
            loss=job.status.loss, cursor=job.status.cursor,
        ),
        newest_checkpoint=checkpoints[0] if checkpoints else None,
        requested_checkpoint=requested,
        holders=holders,
        reason=inputs.reason,
    )
    return plan, time.perf_counter() - started


def _waiting_on_error(inputs: Inputs, holders: list[str], error: Exception) -> pb.Plan:
    """The WAIT plan of a job whose planner raised `error` (module docstring)."""
    job, previous = inputs.job, inputs.previous
    why = f"planner error: {type(error).__name__}: {error}"
    if job.status.planner_error != why:  # once, not at every replan that meets it again
        log.error("job %s: %s", job.id, why)
    job.status.planner_error = why
    progress = inputs.progress or planner.Progress(step=job.status.step, cursor=job.status.cursor)
    plan = pb.Plan(job_id=job.id, spec=job.spec, action=pb.PLAN_ACTION_WAIT,
                   reason=f"{inputs.reason}; {why}" if inputs.reason else why,
                   step=progress.step)
    plan.cursor.CopyFrom(progress.cursor)
    kept = set(holders)
    if previous is not None:
        plan.members.extend(m for m in previous.members if m.member_id in kept)
    kept = {m.member_id for m in plan.members}
    plan.spares.extend(m.id for m in inputs.members if not m.draining and m.id not in kept)
    return plan


def _stamp_generation(status: pb.JobStatus, plan: pb.Plan, previous: pb.Plan | None,
                      requested: pb.CheckpointRef | None) -> None:
    plan.generation = (previous.generation if previous else 0) + 1
    plan.created_at.CopyFrom(timestamp_now())
    # New with every generation, so a member fenced from this one holds no
    # key to the next one's rendezvous (docs/security.md).
    plan.rendezvous_secret = secrets.token_hex(RENDEZVOUS_SECRET_BYTES)
    if requested is not None and plan.restore.kind == pb.RESTORE_KIND_CHECKPOINT:
        status.restore_step = 0  # the operator's restore is planned
    # Progress rewinds when the ranks report the state they actually started
    # from (record_generation_start), not here: this plan may never start.
    status.generation = plan.generation
    status.world_size = plan.world_size
    del status.members[:]
    status.members.extend(m.member_id for m in plan.members if plan.world_size)


def _update_status(status: pb.JobStatus, plan: pb.Plan, ended: bool, paused: bool) -> None:
    kept = ended or (paused and status.state == pb.JOB_STATE_PAUSED)
    if not planner.is_terminal(status.state):
        if plan.action == pb.PLAN_ACTION_RUN:
            status.state = pb.JOB_STATE_RUNNING
        elif status.state == pb.JOB_STATE_RUNNING:
            status.state = pb.JOB_STATE_PENDING
    del status.spares[:]
    status.spares.extend(plan.spares)
    if not kept:  # an ended (or still paused) job's message says why; later changes keep it
        status.message = plan.reason  # the planner may say why the job waits (a layout)
    status.updated_at.CopyFrom(timestamp_now())


def replan(inputs: Inputs) -> Decision:
    """The job's next record and plan (see the module docstring). Mutates
    `inputs.job`, `inputs.members` (draining flags) and, for a spares-only
    update, a copy of `inputs.previous`."""
    job, previous = inputs.job, inputs.previous
    aside = stragglers.active(job.status)  # planned as spares (controls.straggler)
    aside -= {m.id for m in inputs.members if m.draining or m.id in inputs.draining}
    for m in inputs.members:
        m.draining = m.draining or m.id in inputs.draining or m.id in aside
    holders = _keep_holders(job, inputs.members, inputs.stateless)
    requested = None
    if job.status.restore_step:
        requested = next((c for c in inputs.checkpoints if c.step == job.status.restore_step), None)
    try:
        plan, planning_s = _make_plan(inputs, holders, requested)
        interval = ckptinterval.apply(plan, inputs.observed)
        job.status.planner_error = ""
    except Exception as e:  # noqa: BLE001 (one job's error: its plan waits, named; see above)
        plan, planning_s, interval = _waiting_on_error(inputs, holders, e), 0.0, None
    if plan.action != pb.PLAN_ACTION_STOP:
        plan.spares.extend(m.id for m in inputs.members
                           if m.id in aside and m.id not in plan.spares)
    signature = planner.signature(plan)
    new_generation = (inputs.force_generation or previous is None
                      or signature != inputs.previous_signature)
    if new_generation:
        _stamp_generation(job.status, plan, previous, requested)
    _update_status(job.status, plan, inputs.ended, inputs.paused)
    plan_write: pb.Plan | None = plan if new_generation else None
    if not new_generation and previous is not None and list(plan.spares) != list(previous.spares):
        plan_write = pb.Plan()
        plan_write.CopyFrom(previous)
        del plan_write.spares[:]
        plan_write.spares.extend(plan.spares)
    return Decision(job=job, plan=plan, new_generation=new_generation, signature=signature,
                    plan_write=plan_write, planning_s=planning_s, interval=interval)
