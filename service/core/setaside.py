"""The straggler policy's leader side (spec ``controls.straggler``): the
decisions of the pure policy (`policy/stragglers.py`) written as changes.

`act` is called after each step report that carried timing: it reads the job
only when a decision is due (an etcd read per report only once per
leadership) and writes it through `Coordinator.change_with_retry`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from springback.client.errors import Conflict, FailedPrecondition, NotFound
from springback.service.policy import stragglers
from springback.v1 import job_service_pb2 as js
from springback.v1 import types_pb2 as pb

if TYPE_CHECKING:
    from springback.service.core.coordinator import Coordinator

log = logging.getLogger(__name__)


def act(c: Coordinator, job_id: str, generation: int, step: int,
        timing: Sequence[pb.MemberTiming], now_s: float) -> None:
    """Applies the policy after a step report of `job_id`'s `generation`
    (`timing`: its members' figures, named): ends cool-downs that are over,
    and sets aside a straggler the cost model says the job is faster
    without, each as one change of kind CONTROL that lands only while the
    job runs that generation (else nothing is written; judged afresh on the
    next reports). An etcd read per report only once per leadership."""
    s = c.stragglers
    if job_id not in s.specs:
        s.learn(c.get_job(job_id))
    policy = s.specs[job_id].controls.straggler
    if not policy.enabled:
        return
    try:
        if s.next_return.get(job_id, float("inf")) <= now_s:
            _end_cooldowns(c, job_id, now_s)
            return  # a new generation may come of it: its timing starts afresh
        member = s.due(policy, job_id, generation, step, timing)
        if member is not None:
            _set_aside(c, job_id, generation, step, timing, member, now_s)
    except (Conflict, FailedPrecondition, NotFound) as e:
        log.info("job %s: straggler policy not applied: %s", job_id, e)


def _end_cooldowns(c: Coordinator, job_id: str, now_s: float) -> None:
    def back(job: pb.Job) -> str:
        names = stragglers.returns(job.status, now_s)
        if not names:  # another change marked them (an older leader's cache)
            c.stragglers.note_returns(job_id, job.status)
            raise FailedPrecondition("no cool-down is over")
        stragglers.mark_returned(job.status, names)
        c.stragglers.note_returns(job_id, job.status)
        return f"controls.straggler: the cool-down of {', '.join(names)} is over: " \
               "planned as any member again"

    job = c.change_with_retry(job_id, "controls.straggler: cool-down over", back,
                              kind=js.CHANGE_KIND_CONTROL)
    log.warning("job %s: %s", job_id, job.status.message)


def _set_aside(c: Coordinator, job_id: str, generation: int, step: int,
               timing: Sequence[pb.MemberTiming], member: str, now_s: float) -> None:
    job = c.get_job(job_id)
    plan = c.current_plan(job_id)
    if plan is None or plan.generation != generation:
        return
    live = {m.id for m in c.members(job_id)}
    aside = stragglers.active(job.status)
    spares = [m for m in plan.spares if m in live and m not in aside]
    ranks = {m.member_id: m.num_local_ranks for m in plan.members}
    verdict = c.stragglers.judge(job, member, step, timing, ranks, spares,
                                 c.history.events(job_id))
    if isinstance(verdict, str):
        log.info("job %s: controls.straggler: %s", job_id, verdict)
        return

    def evict(current: pb.Job) -> str:
        c.require_state(current, (pb.JOB_STATE_RUNNING,), "set a straggler aside in")
        if current.status.generation != generation:
            raise FailedPrecondition(f"generation {generation} of job {job_id} has ended")
        cooldown = stragglers.set_aside(current.status, member, now_s,
                             current.spec.controls.straggler.cooldown_s)
        c.stragglers.note_returns(job_id, current.status)
        return verdict.reason(cooldown)

    done = c.change_with_retry(job_id, f"controls.straggler: set aside {member}", evict,
                               kind=js.CHANGE_KIND_CONTROL)
    log.warning("job %s: %s", job_id, done.status.message)
