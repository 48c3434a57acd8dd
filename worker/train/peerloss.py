"""Which peer's process died, from a failed collective's error.

When a collective fails with gloo's "connection closed/reset by peer
[ip]:port", `worker.rendezvous.lost_peer_rank` names the peer's rank; the
plan names its member. The rank sends that to the coordinator
(`StepReporter.report_lost_peer`: a ReportFailure with ``lost_member_id``),
which fences the lost member at once if its agent is gone too
(service/evidence.py), instead of waiting for its lease to expire. A peer
of the reporter's own node is not reported (its agent reports its own
ranks' crashes).
"""

from __future__ import annotations

from springback.v1 import types_pb2 as pb
from springback.worker.rank.rendezvous import lost_peer_rank


def member_of_rank(plan: pb.Plan, rank: int) -> str | None:
    """The member whose node runs global `rank` in `plan`, or None."""
    for m in plan.members:
        if m.first_rank <= rank < m.first_rank + m.num_local_ranks:
            return m.member_id
    return None


def lost_peer(exc: BaseException, plan: pb.Plan, member_id: str) -> tuple[int, str] | None:
    """(rank, member) of the peer on another node whose connection reset
    caused `exc`, or None (not a reset, an unknown address, our own node)."""
    peer = lost_peer_rank(exc)
    if peer is None:
        return None
    lost = member_of_rank(plan, peer)
    if lost is None or lost == member_id:
        return None
    return peer, lost
