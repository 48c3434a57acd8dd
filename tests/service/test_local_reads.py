"""A follower answers the agents' start-up read itself (issue 48): a GetJob
that carries `channel.LOCAL_READ` is served from the follower's own etcd read,
not forwarded to the leader, with the same authorization as any call; real
etcd, a real leader and follower on loopback, a token and join credentials."""

from __future__ import annotations

import grpc
import pytest

from sbtest import OPERATOR_TOKEN, wait_for
from springback.client.api import Client
from springback.client.channel import LOCAL_READ, connect
from springback.v1 import job_service_pb2 as js
from springback.v1 import job_service_pb2_grpc as js_grpc
from springback.worker.agent.startup import StartupRefused, check_job

GET_JOB = "/springback.v1.JobService/GetJob"


@pytest.fixture
def replicas(start_coordinator):
    leader = start_coordinator(token=OPERATOR_TOKEN)
    wait_for(leader.election.is_leader, 10, "leadership")
    follower = start_coordinator(token=OPERATOR_TOKEN)
    wait_for(lambda: follower.election.leader_address() == leader.address, 10,
             "the follower to see the leader")
    return leader, follower


class TestAFollowerAnswersTheStartUpRead:
    @pytest.mark.timeout(60)
    def test_the_start_up_check_is_answered_by_the_follower_without_the_leader(
            self, replicas, make_spec):
        leader, follower = replicas
        with Client(leader.address, token=OPERATOR_TOKEN) as client:
            job = client.create_job(make_spec(min_workers=1, max_workers=2))
            join = client.issue_join_credential(job.id)
        forwarded = follower._forwarding.num_forwarded  # noqa: SLF001
        leader_reads = leader.counter.calls[GET_JOB]
        with connect([follower.address], token=join) as channel:
            found = check_job(channel, job_id=job.id, target=follower.address,
                              connect_timeout_s=10, nnodes=(1, 2), drain_reason=lambda: None)
            assert found.id == job.id and found.spec.max_workers == 2
            plain = js_grpc.JobServiceStub(channel).GetJob(
                js.GetJobRequest(job_id=job.id), metadata=(LOCAL_READ,), timeout=5).job
            assert plain.status.state == found.status.state
        assert follower._forwarding.num_forwarded == forwarded  # noqa: SLF001
        assert leader.counter.calls[GET_JOB] == leader_reads  # the leader saw none of it
        # without LOCAL_READ, GetJob still goes to the leader (its step is the freshest)
        with connect([follower.address], token=OPERATOR_TOKEN) as channel:
            js_grpc.JobServiceStub(channel).GetJob(js.GetJobRequest(job_id=job.id), timeout=5)
        assert follower._forwarding.num_forwarded == forwarded + 1  # noqa: SLF001
        assert leader.counter.calls[GET_JOB] == leader_reads + 1

    @pytest.mark.timeout(60)
    def test_a_local_read_is_authorized_as_any_call(self, replicas, make_spec):
        leader, follower = replicas
        with Client(leader.address, token=OPERATOR_TOKEN) as client:
            job_a = client.create_job(make_spec())
            job_b = client.create_job(make_spec())
            join_b = client.issue_join_credential(job_b.id)
        for token, code in ((join_b, grpc.StatusCode.PERMISSION_DENIED),  # another job's
                            ("not-the-token", grpc.StatusCode.UNAUTHENTICATED)):
            with connect([follower.address], token=token) as channel:
                with pytest.raises(StartupRefused, match=code.name):
                    check_job(channel, job_id=job_a.id, target=follower.address,
                              connect_timeout_s=10, nnodes=None, drain_reason=lambda: None)
        with connect([follower.address], token=OPERATOR_TOKEN) as channel:
            with pytest.raises(StartupRefused, match="NOT_FOUND"):
                check_job(channel, job_id="no-such-job", target=follower.address,
                          connect_timeout_s=10, nnodes=None, drain_reason=lambda: None)
        assert follower._forwarding.num_forwarded == 0  # noqa: SLF001
