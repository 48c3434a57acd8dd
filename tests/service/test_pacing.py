"""Paced liveness: a replica tells its members a longer heartbeat interval as
they grow, so its heartbeat rate stays within its budget (service/policy/pacing.py)."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest

from sbtest import wait_for
from springback.service.policy.pacing import HeartbeatPacer
from springback.v1 import worker_service_pb2 as ws

_JOIN = "/springback.v1.WorkerService/JoinJob"
_BEAT = "/springback.v1.WorkerService/Heartbeat"


def test_the_interval_grows_with_the_members_between_a_quarter_and_half_the_timeout():
    pacer = HeartbeatPacer(liveness_timeout_s=8.0, budget_per_s=10.0)
    assert pacer.interval_s() == 2.0  # no members: the floor, a quarter of the timeout
    for i in range(30):
        pacer.seen(f"m{i}", now=100.0)
    assert pacer.interval_s() == 3.0  # 30 members at 10/s
    assert not pacer.over_budget()
    for i in range(30, 100):
        pacer.seen(f"m{i}", now=100.5)
    assert pacer.interval_s() == 4.0  # capped at half the timeout ...
    assert pacer.over_budget()  # ... and the budget says so


def test_members_that_stopped_heartbeating_leave_the_count_after_one_timeout():
    pacer = HeartbeatPacer(liveness_timeout_s=4.0, budget_per_s=1.0)
    for i in range(2):
        pacer.seen(f"old{i}", now=10.0)
    pacer.seen("new", now=13.0)
    assert pacer.num_members == 3  # within the timeout: still counted
    pacer.seen("new", now=15.0)  # 5 s after the old ones' last heartbeat
    assert pacer.num_members == 1


def test_a_budget_that_is_not_positive_is_refused_by_name():
    with pytest.raises(ValueError, match="heartbeat_budget_per_s"):
        HeartbeatPacer(liveness_timeout_s=4.0, budget_per_s=0)


async def _join_and_beat(address: str, job_id: str, n: int) -> list[ws.HeartbeatResponse]:
    """`n` members join, then each heartbeats once; the answers of a second round."""
    async with grpc.aio.insecure_channel(address) as channel:
        join = channel.unary_unary(_JOIN, request_serializer=ws.JoinJobRequest.SerializeToString,
                                   response_deserializer=ws.JoinJobResponse.FromString)
        beat = channel.unary_unary(_BEAT, request_serializer=ws.HeartbeatRequest.SerializeToString,
                                   response_deserializer=ws.HeartbeatResponse.FromString)
        joined = await asyncio.gather(*(join(ws.JoinJobRequest(
            job_id=job_id, host="127.0.0.1", rendezvous_port=21000 + i, num_local_ranks=1,
            join_token=uuid.uuid4().hex), timeout=60) for i in range(n)))
        requests = [ws.HeartbeatRequest(job_id=job_id, member_id=r.member.id) for r in joined]
        await asyncio.gather(*(beat(r, timeout=30) for r in requests))
        return list(await asyncio.gather(*(beat(r, timeout=30) for r in requests)))


@pytest.mark.timeout(120)
def test_a_replica_tells_its_members_the_interval_its_budget_allows(start_coordinator, make_spec):
    """40 members on a replica with a budget of 10 heartbeats/s and an 8 s
    liveness timeout: each is told 4 s (40 / 10, within 2..4 s), not the
    quarter of the timeout (2 s) that a replica tells a lone member."""
    from springback.client.api import Client

    coordinator = start_coordinator(liveness_timeout_s=8.0, heartbeat_budget_per_s=10.0)
    wait_for(coordinator.election.is_leader, 10, "a leader")
    with Client([coordinator.address]) as client:
        job = client.create_job(make_spec(max_workers=40))
    lone = asyncio.run(_join_and_beat(coordinator.address, job.id, 1))
    assert lone[0].heartbeat_interval.ToTimedelta().total_seconds() == pytest.approx(2.0)
    answers = asyncio.run(_join_and_beat(coordinator.address, job.id, 39))
    told = {a.heartbeat_interval.ToTimedelta().total_seconds() for a in answers}
    assert [round(t, 3) for t in told] == [4.0], told  # 40 members heartbeat here
