"""Plan-stream notes reach the leader's peers'-evidence rule (service/transport/streamnotes.py,
service/core/evidence.py), against a real coordinator and etcd: streams are told
apart by id, so notes from two replicas in any order cannot make a live
agent look vanished."""

from __future__ import annotations

import pytest

from sbtest import wait_for
from springback.v1 import worker_service_pb2 as ws

pytestmark = pytest.mark.timeout(60)


def _join(workers, job_id: str, port: int) -> str:
    return workers.JoinJob(ws.JoinJobRequest(job_id=job_id, host="127.0.0.1",
                                             rendezvous_port=port, num_local_ranks=1),
                           timeout=10).member.id


def _notes(workers, *notes: ws.PlanStreamNote) -> None:
    workers.ReportPlanStreams(ws.ReportPlanStreamsRequest(replica="127.0.0.1:1", notes=notes),
                              timeout=5)


def test_an_older_streams_end_relayed_late_does_not_make_a_reconnected_agent_vanish(
        coordinator, client, workers, make_spec):
    job = client.create_job(make_spec(min_workers=2, max_workers=2))
    a = _join(workers, job.id, 9501)
    b = _join(workers, job.id, 9502)
    plan = wait_for(lambda: (p := coordinator.coordinator.current_plan(job.id)).world_size == 2
                    and p, 10, "a plan with both")
    # b's agent reconnected: its new stream (on one follower) is noted before
    # the end of its old one (relayed by another), whose opening the leader
    # never heard of.
    _notes(workers, ws.PlanStreamNote(job_id=job.id, member_id=b, stream_id="f2/7", opened=True))
    _notes(workers, ws.PlanStreamNote(job_id=job.id, member_id=b, stream_id="f1/3",
                                      by_client=True))
    reply = workers.ReportFailure(ws.ReportFailureRequest(
        job_id=job.id, member_id=a, generation=plan.generation, lost_peer=True,
        lost_rank=next(m.first_rank for m in plan.members if m.member_id == b)),
        timeout=5)
    assert reply.generation == plan.generation  # b's stream is open: no fence
    assert set(client.get_job(job.id).status.members) == {a, b}
    # now its open stream ends from the agent's side too: both halves hold
    _notes(workers, ws.PlanStreamNote(job_id=job.id, member_id=b, stream_id="f2/7",
                                      by_client=True))
    status = wait_for(lambda: (s := client.get_job(job.id).status).generation > plan.generation
                      and s, 10, "a generation without b")
    assert b not in status.members and f"lost {b} (peers:" in status.message, status
