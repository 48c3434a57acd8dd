"""Member credentials on real coordinators (a leader and a follower) and a
real etcd: a member may make only its own calls, for its own job; a training
rank holding its member's credential can do nothing to another job."""

from __future__ import annotations

import grpc
import pytest

from sbtest import OPERATOR_TOKEN, VIEWER_TOKEN, wait_for
from springback.client.api import ApiError, Client
from springback.client.channel import connect
from springback.service.transport import credentials
from springback.service.etcd import keys
from springback.v1 import job_service_pb2 as js
from springback.v1 import job_service_pb2_grpc as js_grpc
from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as ws
from springback.v1 import worker_service_pb2_grpc as ws_grpc

pytestmark = pytest.mark.timeout(90)

TOKEN = OPERATOR_TOKEN


@pytest.fixture
def replicas(start_coordinator):
    first = start_coordinator(token=TOKEN)
    wait_for(first.election.is_leader, 10, "leadership")
    second = start_coordinator(token=TOKEN)
    return first, second


def _join(address: str, job_id: str, port: int) -> ws.JoinJobResponse:
    with connect([address], token=TOKEN) as channel:
        return ws_grpc.WorkerServiceStub(channel).JoinJob(ws.JoinJobRequest(
            job_id=job_id, host="127.0.0.1", rendezvous_port=port, num_local_ranks=1,
            join_token=f"join-{port}"), timeout=10)


def _running(leader, job_id: str) -> pb.Plan:
    wait_for(lambda: (p := leader.coordinator.current_plan(job_id)) is not None
             and p.action == pb.PLAN_ACTION_RUN, 20, f"job {job_id} running")
    return leader.coordinator.current_plan(job_id)


def _member_calls(job_id: str, member_id: str, generation: int) -> dict:
    """One request of each member call, naming `job_id` / `member_id`."""
    return {
        "Heartbeat": ws.HeartbeatRequest(job_id=job_id, member_id=member_id),
        "ReportStep": ws.ReportStepRequest(job_id=job_id, member_id=member_id,
                                           generation=generation, step=400),
        "ReportFailure": ws.ReportFailureRequest(job_id=job_id, member_id=member_id,
                                                 generation=generation, reason="forged"),
        "CommitCheckpoint": ws.CommitCheckpointRequest(
            job_id=job_id, member_id=member_id, generation=generation,
            checkpoint=pb.CheckpointRef(step=5, uri=f"file:///tmp/creds/{job_id}/step-5")),
        "ReportCheckpointError": ws.ReportCheckpointErrorRequest(
            job_id=job_id, member_id=member_id, generation=generation, error="forged"),
        "DrainMember": ws.DrainMemberRequest(job_id=job_id, member_id=member_id, reason="forged"),
        "LeaveJob": ws.LeaveJobRequest(job_id=job_id, member_id=member_id, reason="forged"),
        "WatchPlans": ws.WatchPlansRequest(job_id=job_id, member_id=member_id),
    }


def _call(stub: ws_grpc.WorkerServiceStub, name: str, request) -> None:  # noqa: ANN001
    if name == "WatchPlans":
        next(stub.WatchPlans(request, timeout=5))
    else:
        getattr(stub, name)(request, timeout=5)


def _snapshot(store, job_id: str) -> list:  # noqa: ANN001
    return [(e.key, e.mod_revision) for prefix in (keys.job(job_id), keys.plan(job_id),
                                                   keys.members(job_id), keys.CHECKPOINTS)
            for e in store.get_prefix(prefix)]


def test_a_member_of_one_job_can_do_nothing_to_another_job_on_either_replica(
        replicas, make_spec):
    leader, follower = replicas
    with Client(leader.address, token=TOKEN) as client:
        job_a = client.create_job(make_spec(max_workers=1, checkpoint={"uri": "file:///tmp/creds"}))
        job_b = client.create_job(make_spec(max_workers=1, checkpoint={"uri": "file:///tmp/creds"}))
        a = _join(follower.address, job_a.id, 5201)  # issued through the follower
        b = _join(leader.address, job_b.id, 5202)
        assert credentials.member_of(TOKEN, a.member_credential)[:2] == (job_a.id, a.member.id)
        plan_b = _running(leader, job_b.id)
        _running(leader, job_a.id)
        before = _snapshot(leader.store, job_b.id)
        for replica in (leader, follower):
            with connect([replica.address], token=a.member_credential) as channel:
                stub = ws_grpc.WorkerServiceStub(channel)
                for name, request in _member_calls(job_b.id, b.member.id,
                                                   plan_b.generation).items():
                    with pytest.raises(grpc.RpcError) as e:
                        _call(stub, name, request)
                    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, (name, replica)
                    assert b.member.id in e.value.details() and a.member.id in e.value.details()
                # A's member in B's job, B's member in A's job: refused alike
                for job_id, member_id in ((job_b.id, a.member.id), (job_a.id, b.member.id)):
                    with pytest.raises(grpc.RpcError) as e:
                        stub.Heartbeat(ws.HeartbeatRequest(job_id=job_id, member_id=member_id),
                                       timeout=5)
                    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
                # the job API and the replicas' own calls need the operator
                jobs = js_grpc.JobServiceStub(channel)
                for call in (lambda: jobs.GetJob(js.GetJobRequest(job_id=job_b.id), timeout=5),
                             lambda: jobs.CancelJob(js.CancelJobRequest(job_id=job_b.id), timeout=5),
                             lambda: jobs.CreateJob(js.CreateJobRequest(), timeout=5),
                             lambda: stub.JoinJob(ws.JoinJobRequest(job_id=job_b.id), timeout=5)):
                    with pytest.raises(grpc.RpcError) as e:
                        call()
                    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
                    assert "operator" in e.value.details()
                with pytest.raises(grpc.RpcError) as e:
                    stub.ReportPlanStreams(ws.ReportPlanStreamsRequest(), timeout=5)
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "replica" in e.value.details()
        assert _snapshot(leader.store, job_b.id) == before  # nothing of B changed
        status = client.get_job(job_b.id).status
        assert status.state == pb.JOB_STATE_RUNNING and status.step == 0
        assert list(status.members) == [b.member.id] and not client.list_checkpoints(job_b.id)

        # its own calls pass, on either replica (the follower forwards what the leader serves)
        plan_a = leader.coordinator.current_plan(job_a.id)
        for replica in (follower, leader):
            with connect([replica.address], token=a.member_credential) as channel:
                stub = ws_grpc.WorkerServiceStub(channel)
                stub.Heartbeat(ws.HeartbeatRequest(job_id=job_a.id, member_id=a.member.id),
                               timeout=5)
                first = next(stub.WatchPlans(ws.WatchPlansRequest(
                    job_id=job_a.id, member_id=a.member.id), timeout=5))
                assert first.plan.generation == plan_a.generation
        with connect([follower.address], token=a.member_credential) as channel:
            stub = ws_grpc.WorkerServiceStub(channel)
            stub.ReportStep(ws.ReportStepRequest(
                job_id=job_a.id, member_id=a.member.id, generation=plan_a.generation, step=0,
                generation_start=True, restored_from=pb.RESTORE_KIND_NONE), timeout=5)
            stub.ReportStep(ws.ReportStepRequest(
                job_id=job_a.id, member_id=a.member.id, generation=plan_a.generation, step=3),
                timeout=5)
        wait_for(lambda: client.get_job(job_a.id).status.step == 3, 10, "A's own step")


def test_only_the_replica_credential_tells_the_leader_of_plan_streams(
        start_coordinator, make_spec):
    """ReportPlanStreams feeds the peers'-evidence fence: a note from a
    member credential, the viewer or even the operator token is refused
    (PERMISSION_DENIED naming the replica role) and fences nobody; the same
    note with the replicas' credential does."""
    leader = start_coordinator(token=TOKEN, viewer_token=VIEWER_TOKEN,
                               liveness_timeout_s=20.0)  # the leases outlive the test
    wait_for(leader.election.is_leader, 10, "leadership")
    follower = start_coordinator(token=TOKEN, viewer_token=VIEWER_TOKEN,
                                 liveness_timeout_s=20.0)
    with Client(leader.address, token=TOKEN) as client:
        job = client.create_job(make_spec(min_workers=2, max_workers=2))
        a, b = _join(leader.address, job.id, 5211), _join(follower.address, job.id, 5212)
        plan = wait_for(lambda: (p := leader.coordinator.current_plan(job.id)) is not None
                        and p.world_size == 2 and p, 20, "a plan with both")
        # b's agent "vanished": its plan stream ended from the agent's side
        vanished = ws.ReportPlanStreamsRequest(replica=follower.address, notes=[ws.PlanStreamNote(
            job_id=job.id, member_id=b.member.id, stream_id="forged/1", by_client=True)])
        for token in (a.member_credential, VIEWER_TOKEN, TOKEN):
            for replica in (leader, follower):
                with connect([replica.address], token=token) as channel:
                    with pytest.raises(grpc.RpcError) as e:
                        ws_grpc.WorkerServiceStub(channel).ReportPlanStreams(vanished, timeout=5)
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, token
                assert "needs the replica role" in e.value.details(), e.value.details()
        # a's rank saw a reset from b's rank: with a refused note, no fence
        with connect([leader.address], token=a.member_credential) as channel:
            reply = ws_grpc.WorkerServiceStub(channel).ReportFailure(ws.ReportFailureRequest(
                job_id=job.id, member_id=a.member.id, generation=plan.generation,
                lost_peer=True, lost_rank=next(m.first_rank for m in plan.members
                                               if m.member_id == b.member.id)), timeout=5)
        assert reply.generation == plan.generation
        assert set(client.get_job(job.id).status.members) == {a.member.id, b.member.id}
        with connect([leader.address], token=credentials.replica_credential(TOKEN)) as channel:
            ws_grpc.WorkerServiceStub(channel).ReportPlanStreams(vanished, timeout=5)
        status = wait_for(lambda: (s := client.get_job(job.id).status).generation
                          > plan.generation and s, 10, "a generation without b")
        assert b.member.id not in status.members, status
        # and the follower's own relay (a stream of a's opened there) carries that credential
        with connect([follower.address], token=a.member_credential) as channel:
            next(ws_grpc.WorkerServiceStub(channel).WatchPlans(ws.WatchPlansRequest(
                job_id=job.id, member_id=a.member.id), timeout=5))
            wait_for(lambda: follower.stream_notes.num_relayed >= 1, 10, "the note relayed")


def test_a_forged_or_stale_credential_is_unauthenticated(replicas, make_spec):
    leader, _ = replicas
    with Client(leader.address, token=TOKEN) as client:
        job = client.create_job(make_spec(max_workers=1))
        a = _join(leader.address, job.id, 5203)
        lease, mac = a.member_credential.rsplit(".", 2)[1:]
        forged = [
            f"{credentials.PREFIX}.{job.id}.m-someone-else.{lease}.{mac}",  # another member
            f"{credentials.PREFIX}.{job.id}.{a.member.id}.{int(lease, 16) + 1:x}.{mac}",  # lease
            credentials.issue("another-operator-token", job.id, a.member.id,
                              int(lease, 16)),  # other key
            a.member_credential[:-1] + ("0" if a.member_credential[-1] != "0" else "1"),
        ]
        for token in forged:
            with connect([leader.address], token=token) as channel:
                with pytest.raises(grpc.RpcError) as e:
                    ws_grpc.WorkerServiceStub(channel).Heartbeat(ws.HeartbeatRequest(
                        job_id=job.id, member_id=a.member.id), timeout=5)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_without_a_token_no_credential_is_issued(coordinator, make_spec):
    with Client(coordinator.address) as client:
        job = client.create_job(make_spec(max_workers=1))
        with connect([coordinator.address]) as channel:
            response = ws_grpc.WorkerServiceStub(channel).JoinJob(ws.JoinJobRequest(
                job_id=job.id, host="127.0.0.1", rendezvous_port=5204, num_local_ranks=1),
                timeout=10)
        assert response.member_credential == ""


VIEWER = VIEWER_TOKEN


def test_the_viewer_token_reads_jobs_and_the_dashboard_and_changes_nothing(
        start_coordinator, make_spec):
    import urllib.error
    import urllib.request

    server = start_coordinator(token=TOKEN, viewer_token=VIEWER, metrics_listen="127.0.0.1:0")
    wait_for(server.election.is_leader, 10, "leadership")
    with Client(server.address, token=TOKEN) as operator, \
            Client(server.address, token=VIEWER) as viewer:
        job = operator.create_job(make_spec(max_workers=1))
        assert viewer.get_job(job.id).id == job.id
        assert [j.id for j in viewer.list_jobs()] == [job.id]
        assert viewer.list_checkpoints(job.id) == []
        assert viewer.list_job_events(job.id)[0].id == job.id
        before = _snapshot(server.store, job.id)
        for change in (lambda: viewer.create_job(make_spec()), lambda: viewer.cancel_job(job.id),
                       lambda: viewer.pause_job(job.id), lambda: viewer.delete_job(job.id),
                       lambda: viewer.scale_job(job.id, 1, 2)):
            with pytest.raises(ApiError) as e:
                change()
            assert e.value.code == grpc.StatusCode.PERMISSION_DENIED, e.value
            assert "operator" in str(e.value) and "viewer" in str(e.value)
        with connect([server.address], token=VIEWER) as channel:
            with pytest.raises(grpc.RpcError) as e:
                ws_grpc.WorkerServiceStub(channel).JoinJob(ws.JoinJobRequest(
                    job_id=job.id, host="127.0.0.1", rendezvous_port=5205, num_local_ranks=1),
                    timeout=5)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert _snapshot(server.store, job.id) == before
        assert operator.get_job(job.id).status.state == pb.JOB_STATE_PENDING
    base = f"http://{server.metrics_address}"
    for token, code in ((VIEWER, 200), (TOKEN, 200), ("wrong", 401)):
        request = urllib.request.Request(f"{base}/jobs/{job.id}",
                                         headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                got = reply.status
        except urllib.error.HTTPError as refused:
            got = refused.code
        assert got == code, token


def test_a_viewer_token_needs_an_operator_token_that_differs():
    from springback.service.transport.config import CoordinatorConfig

    for config in ({"viewer_token": VIEWER}, {"viewer_token": TOKEN, "token": TOKEN}):
        with pytest.raises(ValueError) as e:
            CoordinatorConfig(etcd="http://127.0.0.1:2379", **config)
        assert str(e.value).startswith("viewer_token:")
