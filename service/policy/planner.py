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
  whose world fits the spec's layout (`client/layout.py`'s `fault`).
  Fewer than min_workers active means WAIT; when enough members are live but
  no prefix fits the layout, the WAIT plan's reason names the layout field
  at fault. The rest are hot spares.
* Layout: the rules of `client/layout.py` (the module that keeps them, read
  by the ranks too): its `resolve` splits dp into replicate x shard for the
  active members, and global ranks are ordered pp, replicate, shard, tp, so
  with equal ranks per node and tp dividing them a TP group stays inside
  one node and, by default, a lost node leaves a full replica.
* Survivors keep their node rank when it is still in range; the others fill
  the vacant ranks in candidate order. Global ranks are contiguous in
  node-rank order, so with equal ranks per node a survivor keeps its ranks.
* Re-partitioning: when no world of the live members fits ``layout.pp``
  stages and the spec allows fewer (``layout.min_pp``), the plan runs the
  most stages, down to min_pp, that a world fits (e.g. 4 -> 3 when one of
  four single-node stages is lost); it grows back to pp when members join.
  The ranks split the layers over the plan's pp (`worker.stage_layers`) and
  move them in memory (`worker/state/reshard.py`).
* Pieces: when nodes hold different pieces of the state (pipeline stages,
  or FSDP shards over single-rank nodes; equal ranks per node), every node
  rank of the new plan goes to a survivor that held the (stage, shard)
  pieces that rank will hold (`MeshLayout.pieces`): the survivor that had that node rank if it
  held them, else the first survivor in order that did; only then do the
  other candidates fill the rest. So a piece with a live holder is never
  left to a spare while holders of another piece fill the world (HSDP 2 x 2
  losing one node keeps one holder of each shard; a pipeline keeps every
  stage's survivors on it).
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

from springback.client import layout as layouts
from springback.v1 import types_pb2 as pb

_TERMINAL = (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED)

MAX_LOCAL_RANKS = 1024
"""Most ranks one member (node) may bring; `JoinJob` refuses more
(`membership.validate_join`). The plan's rank numbers are 32-bit: without a
bound, two members of 2**32 - 1 ranks overflow the world size."""


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


def _active_count(candidates: Sequence[pb.Member], spec: pb.JobSpec) -> tuple[int, str]:
    """(members to activate, '') or (0, why the layout fails the largest
    world that has enough members; '' when too few are live)."""
    limit = min(spec.max_workers, len(candidates))
    prefix = [0]
    for m in candidates[:limit]:
        prefix.append(prefix[-1] + m.num_local_ranks)
    for n in range(limit, max(spec.min_workers, 1) - 1, -1):
        if not layouts.fault(prefix[n], spec.layout):
            return n, ""
    if limit >= max(spec.min_workers, 1):
        return 0, layouts.fault(prefix[limit], spec.layout)
    return 0, ""


def resolve_layout(spec: pb.JobSpec, active: Sequence[pb.Member]) -> layouts.MeshLayout:
    """The generation's layout for the `active` members (`client.layout.resolve`);
    their world must fit the spec's layout (`client.layout.fault`)."""
    return layouts.resolve(spec.layout, (m.num_local_ranks for m in active))


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


def _fewer_stages(candidates: Sequence[pb.Member], spec: pb.JobSpec,
                  n: int) -> tuple[pb.JobSpec, int]:
    """With ``layout.min_pp`` below ``layout.pp``, when no world fits pp
    stages: the spec with the most stages (down to min_pp) that a world of
    the live members fits, and that world's member count; `spec` and `n`
    unchanged when none does."""
    for pp in layouts.fewer_stages(spec.layout):
        fewer = pb.JobSpec()
        fewer.CopyFrom(spec)
        fewer.layout.pp = pp
        count, _ = _active_count(candidates, fewer)
        if count:
            return fewer, count
    return spec, n


def _placed(candidates: Sequence[pb.Member], n: int, previous: pb.Plan | None,
            spec: pb.JobSpec) -> list[pb.Member] | None:
    """The members of node ranks 0 .. n-1 when nodes hold different pieces of
    the state (pipeline stages, or shards spread over single-rank nodes):
    each node rank goes to a survivor that held its piece (the one that had
    that node rank if it did), the rest to the other candidates in order
    (see the module docstring). None when the rule does not apply: no
    previous run, unequal nodes, another pp, shard or tp than the previous
    run's (its pieces are not the new ones), or every node holding every
    piece."""
    if previous is None or previous.action != pb.PLAN_ACTION_RUN or not previous.members:
        return None
    sizes = {m.num_local_ranks for m in candidates[:n]} | {
        m.num_local_ranks for m in previous.members}
    if len(sizes) != 1:
        return None
    size = sizes.pop()
    new, old = resolve_layout(spec, candidates[:n]), previous.layout
    if (new.pp, new.shard, new.tp) != (old.pp, old.shard, old.tp):
        return None  # the pieces themselves change: no survivor holds a new one whole
    wanted = [new.pieces(j * size, size) for j in range(n)]
    if all(w == wanted[0] for w in wanted) and len(wanted[0]) == new.pp * new.shard:
        return None  # every node holds every piece: any node serves any place
    held_layout = layouts.MeshLayout.of(old)
    held = {m.member_id: (m.node_rank, held_layout.pieces(m.first_rank, m.num_local_ranks))
            for m in previous.members}
    slots: list[pb.Member | None] = [None] * n
    taken: set[str] = set()
    for j in range(n):  # its own node rank first, when it held that place's piece
        m = next((c for c in candidates if c.id in held and held[c.id][0] == j), None)
        if m is not None and wanted[j] <= held[m.id][1]:
            slots[j] = m
            taken.add(m.id)
    for j in range(n):  # then any survivor that held the piece
        if slots[j] is None:
            m = next((c for c in candidates if c.id not in taken and c.id in held
                      and wanted[j] <= held[c.id][1]), None)
            if m is not None:
                slots[j] = m
                taken.add(m.id)
    rest = [c for c in candidates if c.id not in taken]
    return [slot if slot is not None else rest.pop(0) for slot in slots]


def _assign_slots(plan: pb.Plan, slots: Sequence[pb.Member]) -> None:
    first_rank = 0
    for j, m in enumerate(slots):
        plan.members.add(member_id=m.id, host=m.host, node_rank=j, first_rank=first_rank,
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
    module docstring); only live ones among them are state sources. Raises
    `ValueError` for a member whose rank count is outside 1..`MAX_LOCAL_RANKS`
    (`replan` makes that a waiting plan that names it).
    """
    spec = job.spec
    plan = pb.Plan(job_id=job.id, spec=spec, reason=reason)
    if is_terminal(job.status.state):
        plan.action = pb.PLAN_ACTION_STOP
        return plan
    candidates, old_rank = _ordered_candidates(members, previous)
    _check_bounds(candidates)
    proven = set(holders)
    live_holders = {m.id for m in candidates if m.id in proven}
    n, fault = (0, "") if job.status.state == pb.JOB_STATE_PAUSED else _active_count(
        candidates, spec)
    if n == 0 and fault and job.status.state != pb.JOB_STATE_PAUSED:
        spec, n = _fewer_stages(candidates, spec, n)
    if n == 0:
        _hold(plan, candidates, previous, live_holders, progress)
        if fault:
            plan.reason = f"{reason}; waiting: {fault}" if reason else f"waiting: {fault}"
        return plan

    slots = _placed(candidates, n, previous, spec)
    active = list(slots) if slots is not None else candidates[:n]
    plan.action = pb.PLAN_ACTION_RUN
    if slots is not None:
        _assign_slots(plan, slots)
    else:
        _assign_ranks(plan, active, old_rank)
    chosen = {m.id for m in active}
    plan.spares.extend(m.id for m in candidates if m.id not in chosen)
    plan.world_size = sum(m.num_local_ranks for m in active)
    plan.layout.CopyFrom(resolve_layout(spec, active).message())
    head = next(m for m in active if m.id == plan.members[0].member_id)
    plan.master_addr = head.host
    plan.master_port = head.rendezvous_port
    _choose_restore(plan, live_holders, progress, newest_checkpoint, requested_checkpoint)
    return plan


def _check_bounds(candidates: Sequence[pb.Member]) -> None:
    """Raises `ValueError` naming the first member whose rank count is out of
    bounds: a record `JoinJob` would have refused (written by something else)."""
    for m in candidates:
        if not 0 < m.num_local_ranks <= MAX_LOCAL_RANKS:
            raise ValueError(f"member {m.id}: num_local_ranks {m.num_local_ranks} is outside "
                             f"1..{MAX_LOCAL_RANKS}")


def _hold(plan: pb.Plan, candidates: Sequence[pb.Member], previous: pb.Plan | None,
          holders: set[str], progress: Progress) -> None:
    """A WAIT plan that keeps the state holders listed (with their old ranks)
    so the plan that follows knows who can serve state."""
    plan.action = pb.PLAN_ACTION_WAIT
    kept = [m for m in previous.members if m.member_id in holders] if previous else []
    plan.members.extend(kept)
    plan.spares.extend(m.id for m in candidates if m.id not in holders)
    plan.step = progress.step
    plan.cursor.CopyFrom(progress.cursor)


def _choose_restore(plan: pb.Plan, holders: set[str], progress: Progress,
                    newest: pb.CheckpointRef | None,
                    requested: pb.CheckpointRef | None) -> None:
    """Where a RUN plan's state comes from (the module docstring's last rule)."""
    source = next((m for m in plan.members if m.member_id in holders), None)
    if requested is not None:
        _restore_from_checkpoint(plan, requested)
    elif source is not None:
        plan.restore.kind = pb.RESTORE_KIND_PEERS
        plan.restore.source_rank = source.first_rank
        if newest is not None:  # if the holders turn out to hold nothing
            plan.restore.checkpoint.CopyFrom(newest)
        plan.step = progress.step
        plan.cursor.CopyFrom(progress.cursor)
    elif newest is not None:
        _restore_from_checkpoint(plan, newest)
    else:
        plan.restore.kind = pb.RESTORE_KIND_NONE


def _restore_from_checkpoint(plan: pb.Plan, ref: pb.CheckpointRef) -> None:
    plan.restore.kind = pb.RESTORE_KIND_CHECKPOINT
    plan.restore.checkpoint.CopyFrom(ref)
    plan.step = ref.step
    plan.cursor.CopyFrom(ref.cursor)
