"""A plan reaches each member as its own slice: O(1) bytes per member, whatever N."""

from __future__ import annotations

import asyncio
import hashlib
import uuid

import grpc
import pytest

from sbtest import wait_for
from springback.client import plans
from springback.service.etcd import keys
from springback.service.etcd.store import Store
from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as ws

N = 1000
SLICE_BUDGET = 1024
"""Bytes a member may be sent per generation (issue 27's target)."""

_JOIN = "/springback.v1.WorkerService/JoinJob"
_WATCH = "/springback.v1.WorkerService/WatchPlans"


async def _join_all(address: str, job_id: str, n: int) -> list[str]:
    """`n` members joined at once. A join the coordinator answers UNAVAILABLE
    (its etcd call timed out: a loaded run saw it) or RESOURCE_EXHAUSTED is
    sent again with the same join token, as an agent does
    (`worker/agent/startup.py` RETRIED_JOIN_CODES), within 120 s."""
    deadline = asyncio.get_running_loop().time() + 120
    async with grpc.aio.insecure_channel(address) as channel:
        join = channel.unary_unary(_JOIN, request_serializer=ws.JoinJobRequest.SerializeToString,
                                   response_deserializer=ws.JoinJobResponse.FromString)

        async def joined(i: int) -> ws.JoinJobResponse:
            request = ws.JoinJobRequest(job_id=job_id, host="127.0.0.1",
                                        rendezvous_port=20000 + i, num_local_ranks=2,
                                        join_token=uuid.uuid4().hex)
            while True:
                left = deadline - asyncio.get_running_loop().time()
                try:
                    return await join(request, timeout=max(left, 0.1))
                except grpc.aio.AioRpcError as e:
                    if e.code() not in (grpc.StatusCode.UNAVAILABLE,
                                        grpc.StatusCode.RESOURCE_EXHAUSTED) or left <= 0:
                        raise
                await asyncio.sleep(0.25)  # a retry's backoff, as the agent's

        replies = await asyncio.gather(*(joined(i) for i in range(n)))
    return [r.member.id for r in replies]


async def _first_responses(address: str, job_id: str, members: list[str],
                           generation: int) -> dict[str, bytes]:
    """Each member's first plan of `generation` (or newer), as the bytes on the wire."""
    async with grpc.aio.insecure_channel(address) as channel:
        watch = channel.unary_stream(_WATCH, request_serializer=ws.WatchPlansRequest.SerializeToString,
                                     response_deserializer=None)

        async def first(member_id: str) -> bytes:
            call = watch(ws.WatchPlansRequest(job_id=job_id, member_id=member_id), timeout=60)
            async for raw in call:
                if ws.WatchPlansResponse.FromString(raw).plan.generation >= generation:
                    call.cancel()
                    return raw
            raise AssertionError(f"{member_id}: stream ended before generation {generation}")

        got = await asyncio.gather(*(first(m) for m in members))
    return dict(zip(members, got))


@pytest.mark.timeout(240)
def test_a_1000_member_plan_reaches_each_member_in_at_most_1_kb(start_coordinator, etcd, make_spec):
    coordinator = start_coordinator(liveness_timeout_s=600.0)  # no heartbeats needed here
    wait_for(coordinator.election.is_leader, 10, "a leader")
    store = Store(etcd.endpoint)
    try:
        from springback.client.api import Client
        with Client([coordinator.address]) as client:
            job = client.create_job(make_spec(
                max_workers=N, data={"num_samples": 10**6, "global_batch_size": 2 * N}))
        members = asyncio.run(_join_all(coordinator.address, job.id, N))
        stored = wait_for(lambda: (e := store.get(keys.plan(job.id))) is not None
                          and len(pb.Plan.FromString(e.value).members) == N and e, 120,
                          f"a plan with all {N}")
        whole = pb.Plan.FromString(stored.value)
        assert len(stored.value) > 20 * SLICE_BUDGET  # what each member was sent before
        sent = asyncio.run(_first_responses(coordinator.address, job.id, members,
                                            whole.generation))
    finally:
        store.close()

    sizes = sorted(len(raw) for raw in sent.values())
    assert sizes[-1] <= SLICE_BUDGET, f"largest slice {sizes[-1]} B, median {sizes[N // 2]} B"
    entries = {m.member_id: m for m in whole.members}
    for member_id, raw in sent.items():
        part = ws.WatchPlansResponse.FromString(raw).plan
        assert part.generation == whole.generation
        assert list(part.members) == [entries[member_id]], member_id
        assert plans.num_nodes(part) == N and part.world_size == 2 * N
        assert plans.node_starts(part)[entries[member_id].node_rank] == (
            entries[member_id].first_rank, 2)
        assert part.digest == hashlib.sha256(stored.value).digest()


def test_only_the_members_a_plan_places_are_sent_its_rendezvous_secret():
    from springback.service.transport.planboard import Posted

    plan = pb.Plan(job_id="j", generation=3, action=pb.PLAN_ACTION_RUN, world_size=2,
                   rendezvous_secret="ab" * 16)
    plan.members.add(member_id="m-a", host="10.0.0.1", node_rank=0, first_rank=0,
                     num_local_ranks=2)
    plan.spares.append("m-spare")
    posted = Posted(plans.set_nodes(plan).SerializeToString(), 1)
    assert posted.slice("m-a").rendezvous_secret == "ab" * 16
    assert posted.slice("m-spare").rendezvous_secret == ""  # runs no rank of it
    assert posted.slice("m-pending").rendezvous_secret == ""  # not in the plan at all
    assert ws.WatchPlansResponse.FromString(posted.response("m-a")).plan.rendezvous_secret


def test_every_generation_gets_a_fresh_128_bit_rendezvous_secret():
    from springback.service.policy.replan import Inputs, replan

    job = pb.Job(id="j")
    job.spec.min_workers, job.spec.max_workers = 1, 1
    job.spec.data.num_samples, job.spec.data.global_batch_size = 64, 8
    job.status.state = pb.JOB_STATE_RUNNING
    members = [pb.Member(id="m-a", job_id="j", host="127.0.0.1", rendezvous_port=1,
                         num_local_ranks=2)]
    previous, secrets = None, []
    for _ in range(3):
        decision = replan(Inputs(job=job, previous=previous, previous_signature=None,
                                 members=members, checkpoints=[], progress=None,
                                 reason="test", force_generation=True))
        previous = decision.plan
        assert previous.action == pb.PLAN_ACTION_RUN, previous.reason
        secrets.append(previous.rendezvous_secret)
    assert all(len(s) == 32 and int(s, 16) >= 0 for s in secrets)
    assert len(set(secrets)) == 3
