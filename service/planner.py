"""Planning a generation: who trains, with which ranks, from which state.

`make_plan` is a pure function of the job, its live members, the previous plan
and what is known about progress and checkpoints; the coordinator decides when
to call it and writes the result. It runs in O(members) (10,000 members plan
in a few milliseconds; see bench/coordinator_scale.py).

Rules, in order:

* A terminal job gets a STOP plan; a paused one a WAIT plan that keeps the
  state holders listed, so the plan after resume can restore from them.
* Candidates are the live, non-draining members: survivors of the previous
  plan first (in their old node-rank order), then joiners by join order.
* The active set is the longest prefix of candidates, at most max_workers,
  whose world size is a multiple of tp * pp and whose dp is a multiple of ep.
  Fewer than min_workers active means WAIT. The rest are hot spares.
* Survivors keep their node rank when it is still in range; the others fill
  the vacant ranks in candidate order. Global ranks are contiguous in
  node-rank order, so with equal ranks per node a survivor keeps its ranks.
* State holders are *proven*, never assumed: the members whose ranks
  reported, at the start of a generation, the state they agreed on
  (`JobStatus.state_holders`), less those whose ranks crashed since. Being
  in the previous plan proves nothing (that generation may never have
  started).
* State comes from an operator-chosen checkpoint if one is pending, else from
  surviving holders (PEERS, the lowest new rank among them broadcasts; the
  plan also names the newest commit, which the ranks restore when none of
  them turns out to hold state), else from the newest committed checkpoint,
  else from scratch (only while nothing was ever committed).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from springback.v1 import types_pb2 as pb

_TERMINAL = (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED)


@dataclass(frozen=True)
class Progress:
    """The last step a generation reported complete."""

    step: int = 0
    samples_consumed: int = 0
    loss: float = 0.0
    cursor: pb.DataCursor = field(default_factory=pb.DataCursor)


def is_terminal(state: int) -> bool:
    return state in _TERMINAL


def signature(plan: pb.Plan | None) -> tuple:
    """What a new generation is about: the action and the rank assignment.

    Two plans with the same signature need no new generation (a change in
    spares alone does not interrupt training).
    """
    if plan is None:
        return ()
    return (
        plan.action,
        tuple((m.member_id, m.node_rank, m.first_rank, m.num_local_ranks) for m in plan.members),
    )


def _ordered_candidates(
    members: Sequence[pb.Member], previous: pb.Plan | None
) -> tuple[list[pb.Member], dict[str, int]]:
    old_rank = {m.member_id: m.node_rank for m in previous.members} if previous else {}
    survivors: list[tuple[int, str, pb.Member]] = []
    joiners: list[tuple[int, str, pb.Member]] = []
    for m in members:
        if m.draining:
            continue
        member_id = m.id
        rank = old_rank.get(member_id)
        if rank is None:
            joiners.append((m.join_order, member_id, m))
        else:
            survivors.append((rank, member_id, m))
    survivors.sort(key=lambda t: t[0])
    joiners.sort(key=lambda t: (t[0], t[1]))
    return [t[2] for t in survivors] + [t[2] for t in joiners], old_rank


def _active_count(candidates: Sequence[pb.Member], spec: pb.JobSpec) -> int:
    group = max(spec.layout.tp, 1) * max(spec.layout.pp, 1)
    ep = max(spec.layout.ep, 1)
    limit = min(spec.max_workers, len(candidates))
    prefix = [0]
    for m in candidates[:limit]:
        prefix.append(prefix[-1] + m.num_local_ranks)
    for n in range(limit, max(spec.min_workers, 1) - 1, -1):
        world = prefix[n]
        if world and world % group == 0 and (world // group) % ep == 0:
            return n
    return 0


def _assign_ranks(plan: pb.Plan, active: Sequence[pb.Member], old_rank: dict[str, int]) -> None:
    n = len(active)
    by_slot: list[pb.Member | None] = [None] * n
    movers = []
    for m in active:
        r = old_rank.get(m.id)
        if r is not None and r < n and by_slot[r] is None:
            by_slot[r] = m
        else:
            movers.append(m)
    movers.reverse()
    first_rank = 0
    add = plan.members.add
    for slot in range(n):
        m = by_slot[slot] or movers.pop()
        add(member_id=m.id, host=m.host, node_rank=slot, first_rank=first_rank,
            num_local_ranks=m.num_local_ranks)
        first_rank += m.num_local_ranks


def make_plan(
    job: pb.Job,
    members: Sequence[pb.Member],
    previous: pb.Plan | None,
    *,
    progress: Progress,
    newest_checkpoint: pb.CheckpointRef | None,
    requested_checkpoint: pb.CheckpointRef | None = None,
    holders: Collection[str] = (),
    reason: str = "",
) -> pb.Plan:
    """The plan for the next generation (its generation number is left 0).

    `holders` names the members proven to hold the state in memory (see the
    module docstring); only live ones among them are state sources.
    """
    spec = job.spec
    plan = pb.Plan(job_id=job.id, spec=spec, reason=reason)
    if is_terminal(job.status.state):
        plan.action = pb.PLAN_ACTION_STOP
        return plan
    candidates, old_rank = _ordered_candidates(members, previous)
    proven = set(holders)
    holders = {m.id for m in candidates if m.id in proven}
    n = 0 if job.status.state == pb.JOB_STATE_PAUSED else _active_count(candidates, spec)
    if n == 0:
        # Hold: keep the state holders listed (with their old ranks) so the
        # plan that follows knows who can serve state.
        plan.action = pb.PLAN_ACTION_WAIT
        kept = [m for m in previous.members if m.member_id in holders] if previous else []
        plan.members.extend(kept)
        plan.spares.extend(m.id for m in candidates if m.id not in holders)
        plan.step = progress.step
        plan.cursor.CopyFrom(progress.cursor)
        return plan

    active = candidates[:n]
    plan.action = pb.PLAN_ACTION_RUN
    _assign_ranks(plan, active, old_rank)
    plan.spares.extend(m.id for m in candidates[n:])
    plan.world_size = sum(m.num_local_ranks for m in active)
    tp, pp, ep = spec.layout.tp or 1, spec.layout.pp or 1, spec.layout.ep or 1
    plan.layout.CopyFrom(pb.ParallelLayout(dp=plan.world_size // (tp * pp), tp=tp, pp=pp, ep=ep))
    head = next(m for m in active if m.id == plan.members[0].member_id)
    plan.master_addr = head.host
    plan.master_port = head.rendezvous_port

    source = next((m for m in plan.members if m.member_id in holders), None)
    if requested_checkpoint is not None:
        _restore_from_checkpoint(plan, requested_checkpoint)
    elif source is not None:
        plan.restore.kind = pb.RESTORE_KIND_PEERS
        plan.restore.source_rank = source.first_rank
        if newest_checkpoint is not None:  # if the holders turn out to hold nothing
            plan.restore.checkpoint.CopyFrom(newest_checkpoint)
        plan.step = progress.step
        plan.cursor.CopyFrom(progress.cursor)
    elif newest_checkpoint is not None:
        _restore_from_checkpoint(plan, newest_checkpoint)
    else:
        plan.restore.kind = pb.RESTORE_KIND_NONE
    return plan


def _restore_from_checkpoint(plan: pb.Plan, ref: pb.CheckpointRef) -> None:
    plan.restore.kind = pb.RESTORE_KIND_CHECKPOINT
    plan.restore.checkpoint.CopyFrom(ref)
    plan.step = ref.step
    plan.cursor.CopyFrom(ref.cursor)
