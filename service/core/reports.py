"""A member's reports of its training, taken by the leader: each step
(`record_progress`, in memory: progress, the loss series, step timing; the
job succeeds at ``max_steps``) and each generation's start (`record_generation_start`,
one etcd write per generation: the state holders, steps redone, a state loss).
Both accept only a report of the job's current generation from one of its
planned members (`check_generation`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from springback.client.errors import StaleGeneration
from springback.service.core import setaside
from springback.service.core.jobstate import PlanView
from springback.service.policy import planner
from springback.v1 import job_service_pb2 as js
from springback.v1 import types_pb2 as pb

if TYPE_CHECKING:
    from springback.service.core.coordinator import Coordinator

log = logging.getLogger(__name__)


def check_generation(c: Coordinator, job_id: str, generation: int) -> None:
    """Raises `StaleGeneration` unless `generation` is the job's current one.

    On the leader a report from a newer generation than the cached one
    is checked against etcd: between a change's write and `Coordinator._applied` a
    plan is in etcd (members see it there) but not yet cached, and a
    member's report from it is current, not stale (then cached here)."""
    current = c.current_generation(job_id)
    if generation > current and c.election.is_leader():
        plan = c.current_plan(job_id)
        if plan is not None and plan.generation > current:
            current = c.remember_plan(job_id, plan).generation
    if generation != current:
        raise StaleGeneration(job_id, generation, current)


def record_progress(c: Coordinator, job_id: str, member_id: str, generation: int,
                    progress: planner.Progress, checkpoint_stall_s: float = 0.0,
                    stall_total_s: float = 0.0,
                    step_quantiles: tuple[float, float, float] = (0.0, 0.0, 0.0),
                    member_timing: Sequence[pb.MemberTiming] = (),
                    store_intrusion: str = "") -> int:
    """Accepts a step report from a member of the current generation.

    In memory only. The member's registration is read from etcd at most
    every `leases.MEMBER_CHECK_S`: a member whose lease expired is NOT_FOUND
    within that long, and until the leader replans without it its reports
    still come from the current generation's training, so counting them
    is right. The job succeeds (one read, one write) when max_steps is
    reached. The job's max_steps is read once per leadership: no request
    changes it. The report's time and `checkpoint_stall_s` are kept for
    the auto checkpoint interval (`ckptinterval`); the time and
    `stall_total_s` (the generation's stalls summed) for badput by cause;
    `member_timing` (rank 0's per-member step timing) for `get_job`;
    `store_intrusion` (rank 0 found an outsider's keys in the generation's
    store) is recorded on the job (`_record_intrusion`).
    """
    c.require_leader()
    now = time.monotonic()
    c.leases.check_registered(job_id, member_id, now)
    with c.changed:
        check_generation(c, job_id, generation)
        state = c.job_state(job_id)
        if state.plan is None or member_id not in state.plan.members:
            raise StaleGeneration(job_id, generation, c.current_generation(job_id))
        previous = state.progress
        if previous is None or progress.step >= previous.step:
            if previous is None or progress.step > previous.step:
                state.series.append((time.time(), progress.step, progress.loss))
            state.progress = progress
            state.dirty = True
            if member_timing:
                state.member_timing = (generation, _named(state.plan, member_timing))
            measures = state.measures
            measures.step_reported(generation, progress.step, checkpoint_stall_s, now)
            c.history.on_progress(job_id, generation, stall_total_s=stall_total_s,
                                  step_s=measures.step_s, step_quantiles=step_quantiles)
            c.notify(job_id, f"step {progress.step}")
        timing = (state.member_timing[1] if member_timing
                  and state.member_timing[0] == generation else None)
    if timing:
        setaside.act(c, job_id, generation, progress.step, timing, time.time())
    if store_intrusion:
        _record_intrusion(c, job_id, store_intrusion)
    state = c.job_state(job_id)
    max_steps = state.max_steps
    if max_steps is None:
        max_steps = state.max_steps = c.get_job(job_id).spec.max_steps
    if progress.step >= max_steps and c.get_job(job_id).status.state == pb.JOB_STATE_RUNNING:
        def succeed(job: pb.Job) -> None:
            job.status.state = pb.JOB_STATE_SUCCEEDED
        c.change_with_retry(job_id, f"reached max_steps {max_steps}", succeed,
                            kind=js.CHANGE_KIND_FINISH)
    return c.current_generation(job_id)


def _record_intrusion(c: Coordinator, job_id: str, found: str) -> None:
    """Counts an intrusion attempt on the job's rendezvous store (what
    rank 0 `found`, which names its generation) in the job's status and
    says it in its message: one etcd write, no new generation; a
    repeated report of the same finding changes nothing."""
    said = f"rendezvous store intrusion attempt: {found}"

    def record(job: pb.Job) -> str:
        status = job.status
        if status.last_store_intrusion == found:
            return status.message
        status.num_store_intrusions += 1
        status.last_store_intrusion = found
        log.warning("job %s: %s", job_id, said)
        return said

    c.change_with_retry(job_id, said, record, kind=js.CHANGE_KIND_OTHER)


def record_generation_start(c: Coordinator, job_id: str, member_id: str,
                            generation: int, progress: planner.Progress, restored_from: int,
                            state_lost: str = "",
                            spans: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> None:
    """Rank 0's word that generation `generation` agreed on the state of
    `progress.step`, taken from `restored_from` (memory, a checkpoint, or
    nothing).

    This is what proves state holders: every member of the generation
    holds that state now. A start behind the reported progress rewinds it
    and counts the steps redone; a restore from a checkpoint is counted.
    A start from nothing (`RESTORE_KIND_NONE`) behind the reported
    progress is a *state loss* (the ranks' `state_lost` says why; the
    DDP form's fresh start says nothing and is caught here all the same):
    counted in ``num_state_losses`` and ``steps_lost``, marked on the
    generation's event and the job's message, and with
    ``failures.on_state_lost: fail`` the job ends FAILED instead.
    `spans` (rank 0's start-up, rendezvous and transfer seconds) and the
    report's arrival are recorded on the generation's event (badput).
    One etcd write per generation. Raises `StaleGeneration` for an old
    generation (nothing changes); idempotent for a repeated report.
    """
    c.require_leader()
    with c.changed:
        check_generation(c, job_id, generation)
        view = c.job_state(job_id).plan
        if view is None or member_id not in view.members:
            raise StaleGeneration(job_id, generation, c.current_generation(job_id))
        holders = sorted(view.members)
    c.history.note_start(job_id, generation)
    reason = f"generation {generation} started at step {progress.step} (state from " \
             f"{pb.RestoreKind.Name(restored_from).removeprefix('RESTORE_KIND_').lower()})"

    rolled_back = [False]  # set by the attempt that lands (a retry sets it afresh)

    def started(job: pb.Job) -> str | None:
        status = job.status
        rolled_back[0] = False
        waited_for_storage = status.HasField("storage_unavailable_since")
        status.ClearField("storage_unavailable_since")  # the store answered
        if (not waited_for_storage and status.holders_step == progress.step
                and list(status.state_holders) == holders):
            return status.message  # a repeated report: what was said stands
        redone = max(status.step - progress.step, 0)
        rolled_back[0] = redone > 0
        lost = redone if restored_from == pb.RESTORE_KIND_NONE and redone else 0
        status.steps_redone += redone
        why, said = "", None
        if lost:
            why = state_lost or "no rank held the trained state and nothing was committed"
            status.num_state_losses += 1
            status.steps_lost += lost
            said = f"state lost: {lost} trained steps (to step {status.step}) thrown " \
                     f"away, generation {generation} started from scratch: {why}"
            if job.spec.failures.on_state_lost == pb.STATE_LOST_POLICY_FAIL:
                status.state = pb.JOB_STATE_FAILED
                said = f"failed (failures.on_state_lost: fail): {said}"
            log.error("job %s: %s", job_id, said)
        c.history.on_start(job_id, generation, step=progress.step, steps_redone=redone,
                           restored_from=restored_from, state_lost=why, steps_lost=lost,
                           spans=spans)
        if restored_from == pb.RESTORE_KIND_CHECKPOINT:
            status.num_restores += 1
        status.step = progress.step
        status.samples_consumed = progress.samples_consumed
        status.cursor.CopyFrom(progress.cursor)
        del status.state_holders[:]
        status.state_holders.extend(holders)
        status.holders_step = progress.step
        with c.changed:  # reports of the new generation count from here
            c.job_state(job_id).progress = progress
        return said

    c.change_with_retry(job_id, reason, started, kind=js.CHANGE_KIND_OTHER)
    if rolled_back[0]:
        with c.changed:
            c.job_state(job_id).measures.rollbacks += 1


def _named(plan: PlanView, timing: Sequence[pb.MemberTiming]) -> list[pb.MemberTiming]:
    """Rank 0's per-node timing (by node rank: its plan slice names no other
    member) with each node's member named from the leader's whole plan;
    a node rank the plan does not have is dropped."""
    by_node = {node_rank: member_id for member_id, node_rank, _, _ in plan.signature[1]}
    out = []
    for t in timing:
        if t.node_rank in by_node:
            named = pb.MemberTiming()
            named.CopyFrom(t)
            named.member_id = by_node[t.node_rank]
            out.append(named)
    return out
