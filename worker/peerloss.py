"""A rank tells the coordinator which peer's process died (its connection reset).

When a collective fails with gloo's "connection closed/reset by peer
[ip]:port", `worker.rendezvous.lost_peer_rank` names the peer's rank; the
plan names its member. The rank sends that in a ReportFailure with
``lost_member_id`` (its own member id as the reporter), and the coordinator
fences the lost member at once if its agent is gone too
(service/evidence.py), instead of waiting for its lease to expire.

Failure semantics: best effort, never raises. One call with a
``REPORT_TIMEOUT_S`` deadline; a refusal (stale generation: someone else's
report already replanned; the peer already fenced) or an unreachable
coordinator is logged and changes nothing here: the liveness timeout still
fences a lost node. A peer of the reporter's own node is not reported (its
agent reports its own ranks' crashes).
"""

from __future__ import annotations

import logging
from typing import Any

import grpc

from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as wpb
from springback.worker.rendezvous import lost_peer_rank

log = logging.getLogger(__name__)

REPORT_TIMEOUT_S = 2.0


def member_of_rank(plan: pb.Plan, rank: int) -> str | None:
    """The member whose node runs global `rank` in `plan`, or None."""
    for m in plan.members:
        if m.first_rank <= rank < m.first_rank + m.num_local_ranks:
            return m.member_id
    return None


def report_lost_peer(exc: BaseException, *, plan: pb.Plan, rank: int, member_id: str,
                     stub: Any) -> str | None:
    """Reports the peer member whose connection reset caused `exc`; returns
    its member id when a report was sent (accepted or not), else None."""
    peer = lost_peer_rank(exc)
    if peer is None or stub is None:
        return None
    lost = member_of_rank(plan, peer)
    if lost is None or lost == member_id:
        return None
    request = wpb.ReportFailureRequest(
        job_id=plan.job_id, member_id=member_id, generation=plan.generation,
        reason=f"rank {rank} saw rank {peer}'s connection reset", lost_member_id=lost,
        lost_rank=peer)
    try:
        stub.ReportFailure(request, timeout=REPORT_TIMEOUT_S)
        log.warning("rank %d: reported lost peer rank %d (%s)", rank, peer, lost)
    except grpc.RpcError as e:
        log.warning("rank %d: report of lost peer %s not taken: %s", rank, lost,
                 e.details() if hasattr(e, "details") else e)
    return lost
