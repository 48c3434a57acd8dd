"""A plan's nodes, read the same way from a whole plan and from a member's slice.

The coordinator keeps whole plans (every member, in node_rank order); what a
member is sent is its own slice (service/transport/planboard.py): its own entry in
``members`` and the shape of the rest in ``nodes``, every node's size as runs
of equal size (one run for the usual job of equal nodes), so a plan costs
each member O(1) bytes whatever the number of nodes. Ranks need the shape,
never the others' names: which node runs a rank, where each node's ranks
start; a lost peer is reported by rank and the coordinator names its member.
Pure functions, no I/O.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from springback.v1 import types_pb2 as pb


def runs_of(sizes: Iterable[int]) -> list[pb.NodeRun]:
    """Node sizes (in node_rank order) as runs of equal size."""
    runs: list[pb.NodeRun] = []
    for size in sizes:
        if runs and runs[-1].num_local_ranks == size:
            runs[-1].num_nodes += 1
        else:
            runs.append(pb.NodeRun(num_nodes=1, num_local_ranks=size))
    return runs


def set_nodes(plan: pb.Plan) -> pb.Plan:
    """Fills `plan.nodes` from its members (a whole plan) and returns it."""
    del plan.nodes[:]
    plan.nodes.extend(runs_of(m.num_local_ranks for m in plan.members))
    return plan


def node_starts(plan: pb.Plan) -> list[tuple[int, int]]:
    """(first rank, number of ranks) of every node, in node_rank order."""
    out: list[tuple[int, int]] = []
    first = 0
    for run in plan.nodes:
        for _ in range(run.num_nodes):
            out.append((first, run.num_local_ranks))
            first += run.num_local_ranks
    return out


def num_nodes(plan: pb.Plan) -> int:
    return sum(run.num_nodes for run in plan.nodes)


def node_of_rank(plan: pb.Plan, rank: int) -> int | None:
    """The node_rank of the node that runs global `rank`, or None."""
    starts = node_starts(plan)
    i = bisect.bisect_right([first for first, _ in starts], rank) - 1
    if i < 0 or rank >= starts[i][0] + starts[i][1]:
        return None
    return i


def member_of_rank(plan: pb.Plan, rank: int) -> str | None:
    """The member whose node runs global `rank` in a whole plan (the
    coordinator's: a slice names no other member), or None."""
    return next((m.member_id for m in plan.members
                 if m.first_rank <= rank < m.first_rank + m.num_local_ranks), None)


def own_entry(plan: pb.Plan, member_id: str) -> pb.PlanMember | None:
    """`member_id`'s entry (its node's place) in a plan or its slice."""
    return next((m for m in plan.members if m.member_id == member_id), None)


def store_prefix(job_id: str, generation: int, secret: str) -> str:
    """The rendezvous-store prefix every key of one generation lies under:
    ``springback/<job>/g<generation>/<secret>/``, the secret being the plan's
    `rendezvous_secret` (worker/rank/rendezvous.py). An empty secret (a plan
    of a coordinator older than that field) gives the old predictable
    ``springback/<job>/g<generation>/``: every rank of that generation got
    the same plan, so they still meet, unprotected (callers warn). Raises
    ValueError for a secret that is neither empty nor 32 or more lowercase
    hex digits."""
    if not secret:
        return f"springback/{job_id}/g{generation}/"
    if len(secret) < 32 or secret.strip("0123456789abcdef"):
        raise ValueError(f"generation {generation}'s rendezvous secret is not 32 or more "
                         "hex digits")
    return f"springback/{job_id}/g{generation}/{secret}/"
