"""Which peer's process died, from a failed collective's error.

When a collective fails with gloo's "connection closed/reset by peer
[ip]:port", `worker.rendezvous.lost_peer_rank` names the peer's rank. The
rank sends that to the coordinator (`StepReporter.report_lost_peer`: a
ReportFailure with ``lost_peer`` and ``lost_rank``), which finds the member
that runs it in the plan and fences it at once if its agent is gone too
(service/core/evidence.py), instead of waiting for its lease to expire. A peer
of the reporter's own node is not reported (its agent reports its own
ranks' crashes); the rank knows its own node's ranks from its slice of the
plan, not the other members' names.
"""

from __future__ import annotations

from springback.client import plans
from springback.v1 import types_pb2 as pb
from springback.worker.rank.rendezvous import lost_peer_rank


def lost_peer(exc: BaseException, plan: pb.Plan, member_id: str) -> int | None:
    """The rank of the peer on another node whose connection reset caused
    `exc`, or None (not a reset, an unknown address, a rank of our own node)."""
    peer = lost_peer_rank(exc)
    if peer is None or plans.node_of_rank(plan, peer) is None:
        return None
    me = plans.own_entry(plan, member_id)
    if me is not None and me.first_rank <= peer < me.first_rank + me.num_local_ranks:
        return None
    return peer
