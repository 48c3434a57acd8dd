"""Join credentials on real coordinators (a leader and a follower) and a real
etcd: a job's join credential joins and reads that job only, so a node that
runs agents of one job holds nothing that reaches another job or job control."""

from __future__ import annotations

import grpc
import pytest

from sbtest import OPERATOR_TOKEN, VIEWER_TOKEN, wait_for
from springback.cli.main import main
from springback.client.api import ApiError, Client
from springback.client.channel import connect
from springback.service.transport import credentials
from springback.service.etcd import keys
from springback.v1 import job_service_pb2 as js
from springback.v1 import job_service_pb2_grpc as js_grpc
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


def _join_request(job_id: str, port: int) -> ws.JoinJobRequest:
    return ws.JoinJobRequest(job_id=job_id, host="127.0.0.1", rendezvous_port=port,
                             num_local_ranks=1, join_token=f"join-{port}")


def _snapshot(store, job_id: str) -> list:  # noqa: ANN001
    return [(e.key, e.mod_revision) for prefix in (keys.job(job_id), keys.plan(job_id),
                                                   keys.members(job_id))
            for e in store.get_prefix(prefix)]


def test_a_join_credential_joins_and_reads_its_job_only_on_either_replica(replicas, make_spec):
    leader, follower = replicas
    with Client(leader.address, token=TOKEN) as client:
        job_a = client.create_job(make_spec(max_workers=2))
        job_b = client.create_job(make_spec(max_workers=2))
        join_a = client.issue_join_credential(job_a.id)
        assert credentials.job_joined_by(TOKEN, join_a) == job_a.id
        before = _snapshot(leader.store, job_b.id)
        for port, replica in ((5301, leader), (5302, follower)):
            with connect([replica.address], token=join_a) as channel:
                workers = ws_grpc.WorkerServiceStub(channel)
                jobs = js_grpc.JobServiceStub(channel)
                # its own job: read, joined (the member gets its own credential)
                assert jobs.GetJob(js.GetJobRequest(job_id=job_a.id), timeout=5).job.id == job_a.id
                joined = workers.JoinJob(_join_request(job_a.id, port), timeout=10)
                assert credentials.member_of(TOKEN, joined.member_credential)[:2] == (
                    job_a.id, joined.member.id)
                # another job: neither read nor joined
                for call in (lambda: jobs.GetJob(js.GetJobRequest(job_id=job_b.id), timeout=5),
                             lambda: workers.JoinJob(_join_request(job_b.id, port), timeout=5)):
                    with pytest.raises(grpc.RpcError) as e:
                        call()
                    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, replica
                    assert job_a.id in e.value.details() and job_b.id in e.value.details()
                # job control, listing, the member calls, new credentials: not at all
                for call in (lambda: jobs.ListJobs(js.ListJobsRequest(), timeout=5),
                             lambda: jobs.CancelJob(js.CancelJobRequest(job_id=job_a.id), timeout=5),
                             lambda: jobs.CreateJob(js.CreateJobRequest(), timeout=5),
                             lambda: jobs.IssueJoinCredential(
                                 js.IssueJoinCredentialRequest(job_id=job_b.id), timeout=5),
                             lambda: workers.Heartbeat(ws.HeartbeatRequest(
                                 job_id=job_a.id, member_id=joined.member.id), timeout=5)):
                    with pytest.raises(grpc.RpcError) as e:
                        call()
                    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, replica
                    assert "operator" in e.value.details()
        assert _snapshot(leader.store, job_b.id) == before  # nothing of B changed
        assert not client.get_job(job_b.id).status.members
        wait_for(lambda: len(client.get_job(job_a.id).status.members) == 2, 10, "A's two members")


def test_only_operators_issue_join_credentials(start_coordinator, make_spec):
    viewer = VIEWER_TOKEN
    server = start_coordinator(token=TOKEN, viewer_token=viewer)
    with Client(server.address, token=TOKEN) as client:
        job = client.create_job(make_spec(max_workers=1))
        with pytest.raises(ApiError) as e:
            client.issue_join_credential("no-such-job")
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        joined = ws_grpc.WorkerServiceStub(connect([server.address], token=TOKEN)).JoinJob(
            _join_request(job.id, 5303), timeout=10)
    for token in (viewer, joined.member_credential):
        with Client(server.address, token=token) as client:
            with pytest.raises(ApiError) as e:
                client.issue_join_credential(job.id)
            assert e.value.code == grpc.StatusCode.PERMISSION_DENIED


def test_a_forged_join_credential_is_unauthenticated(start_coordinator, make_spec):
    server = start_coordinator(token=TOKEN)
    with Client(server.address, token=TOKEN) as client:
        job = client.create_job(make_spec(max_workers=1))
        real = client.issue_join_credential(job.id)
    forged = [credentials.issue_join("another-operator-token", job.id),
              real[:-1] + ("0" if real[-1] != "0" else "1"),
              f"{credentials.JOIN_PREFIX}.other-job.{real.rsplit('.', 1)[1]}"]
    for token in forged:
        with connect([server.address], token=token) as channel:
            with pytest.raises(grpc.RpcError) as e:
                ws_grpc.WorkerServiceStub(channel).JoinJob(_join_request(job.id, 5304), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_join_credential_relabelled_as_a_member_credential_is_unauthenticated(
        start_coordinator, make_spec):
    """Each kind of credential has its own HKDF key: the MAC of job A's join
    credential, presented as member A of a job called ``join`` (once the
    same HMAC input, ``join/A``, under one key), verifies as nothing."""
    server = start_coordinator(token=TOKEN)
    wait_for(server.election.is_leader, 10, "leadership")
    with Client(server.address, token=TOKEN) as client:
        job = client.create_job(make_spec(max_workers=1))
        mac = client.issue_join_credential(job.id).rsplit(".", 1)[1]
    relabelled = f"{credentials.PREFIX}.join.{job.id}.{mac}"
    with connect([server.address], token=relabelled) as channel:
        with pytest.raises(grpc.RpcError) as e:
            ws_grpc.WorkerServiceStub(channel).Heartbeat(
                ws.HeartbeatRequest(job_id="join", member_id=job.id), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value.details()
    assert credentials.member_of(TOKEN, relabelled) is None


def test_credential_keys_are_hkdf_sha256_one_per_kind():
    # RFC 5869, test case 1
    okm = credentials.hkdf_sha256(bytes.fromhex("0b" * 22),
                                  bytes.fromhex("000102030405060708090a0b0c"),
                                  bytes.fromhex("f0f1f2f3f4f5f6f7f8f9"), 42)
    assert okm.hex() == ("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf"
                         "34007208d5b887185865")
    derived = {credentials.derive_key(TOKEN, kind) for kind in credentials.KINDS}
    assert len(derived) == len(credentials.KINDS) and all(len(k) == 32 for k in derived)
    assert credentials.derive_key(TOKEN, "member") == credentials.hkdf_sha256(
        TOKEN.encode(), credentials.HKDF_SALT, b"springback/member")
    with pytest.raises(ValueError, match="kind 'viewer'"):
        credentials.derive_key(TOKEN, "viewer")


def test_without_a_token_no_join_credential_is_issued(coordinator, make_spec):
    with Client(coordinator.address) as client:
        job = client.create_job(make_spec(max_workers=1))
        with pytest.raises(ApiError) as e:
            client.issue_join_credential(job.id)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "--token" in str(e.value)


def test_the_cli_prints_the_join_credential(start_coordinator, make_spec, capsys):
    server = start_coordinator(token=TOKEN)
    with Client(server.address, token=TOKEN) as client:
        job = client.create_job(make_spec(max_workers=1))
        assert main(["--coordinator", server.address, "--token", TOKEN,
                     "job", "join-credential", job.id]) == 0
        assert capsys.readouterr().out.strip() == client.issue_join_credential(job.id)
