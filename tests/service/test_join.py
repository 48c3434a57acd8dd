"""Idempotent joins: a retry with the same join token returns the same member."""

from __future__ import annotations

import threading

import grpc
import pytest

from netproxy import DOWN, NetProxy
from sbtest import wait_for
from springback.service.etcd import keys
from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as ws
from springback.v1 import worker_service_pb2_grpc as ws_grpc

pytestmark = pytest.mark.timeout(60)


def request(job_id: str, token: str, port: int = 9701) -> ws.JoinJobRequest:
    return ws.JoinJobRequest(job_id=job_id, host="127.0.0.1", rendezvous_port=port,
                             num_local_ranks=1, join_token=token)


def registered(coordinator, job_id: str) -> list[pb.Member]:
    return [e.value for e in coordinator.store.get_prefix(keys.members(job_id), pb.Member)]


class TestIdempotentJoin:
    def test_a_join_retried_with_its_token_is_the_same_member(self, coordinator, client, make_spec):
        job = client.create_job(make_spec(max_workers=2))
        with grpc.insecure_channel(coordinator.address) as channel:
            workers = ws_grpc.WorkerServiceStub(channel)
            first = workers.JoinJob(request(job.id, "join-1"), timeout=10).member
            generation = client.get_job(job.id).status.generation
            again = workers.JoinJob(request(job.id, "join-1"), timeout=10).member
            assert again.id == first.id and again.join_token == "join-1"
            assert [m.id for m in registered(coordinator, job.id)] == [first.id]
            assert client.get_job(job.id).status.generation == generation  # nothing replanned
            other = workers.JoinJob(request(job.id, "join-2", port=9702), timeout=10).member
            assert other.id != first.id
            with pytest.raises(grpc.RpcError) as e:  # the token of another join
                workers.JoinJob(request(job.id, "join-1", port=9703), timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith("join_token:")
            with pytest.raises(grpc.RpcError) as e:
                workers.JoinJob(request(job.id, "x" * 129), timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert len(registered(coordinator, job.id)) == 2

    def test_a_join_whose_reply_was_lost_registers_one_member_when_retried(
        self, coordinator, client, make_spec
    ):
        job = client.create_job(make_spec(max_workers=2))
        with NetProxy(coordinator.address) as link, grpc.insecure_channel(link.address) as channel:
            workers = ws_grpc.WorkerServiceStub(channel)
            with pytest.raises(grpc.RpcError):  # connects the channel through the link
                workers.Heartbeat(ws.HeartbeatRequest(job_id=job.id, member_id="m-none"), timeout=5)
            link.hold(DOWN)  # replies stop arriving
            lost: list[grpc.RpcError] = []

            def join_once() -> None:
                try:
                    workers.JoinJob(request(job.id, "agent-7"), timeout=20)
                except grpc.RpcError as e:
                    lost.append(e)

            attempt = threading.Thread(target=join_once)
            attempt.start()
            wait_for(lambda: registered(coordinator, job.id), 10, "the join to be registered")
            link.reset().heal()  # the reply dies with the connection
            attempt.join(20)
            assert [e.code() for e in lost] == [grpc.StatusCode.UNAVAILABLE]
            member = workers.JoinJob(request(job.id, "agent-7"), timeout=10).member  # the retry
            assert [m.id for m in registered(coordinator, job.id)] == [member.id]
            plan = coordinator.coordinator.current_plan(job.id)
            assert [m.member_id for m in plan.members] == [member.id]


class TestBoundedInput:
    @pytest.mark.parametrize("host", ["two words", "a" * 254, "evil\nhost", "h/x", "-lead"])
    def test_a_join_with_a_bad_host_is_refused_naming_the_field(self, coordinator, client, make_spec, host):
        job = client.create_job(make_spec(max_workers=2))
        bad = ws.JoinJobRequest(job_id=job.id, host=host, rendezvous_port=9701, num_local_ranks=1)
        with grpc.insecure_channel(coordinator.address) as channel:
            with pytest.raises(grpc.RpcError) as e:
                ws_grpc.WorkerServiceStub(channel).JoinJob(bad, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("host:")
        assert registered(coordinator, job.id) == []

    def test_free_text_reasons_are_truncated(self, coordinator, client, make_spec):
        from springback.service.transport.servicers import MAX_REASON_CHARS

        job = client.create_job(make_spec(max_workers=2))
        with grpc.insecure_channel(coordinator.address) as channel:
            workers = ws_grpc.WorkerServiceStub(channel)
            first = workers.JoinJob(request(job.id, "j-1"), timeout=10).member
            second = workers.JoinJob(request(job.id, "j-2", port=9702), timeout=10).member
            workers.DrainMember(ws.DrainMemberRequest(job_id=job.id, member_id=second.id,
                                                      reason="d" * 100_000), timeout=10)
            workers.LeaveJob(ws.LeaveJobRequest(job_id=job.id, member_id=first.id,
                                                reason="x" * 100_000), timeout=10)
        seen = str(client.get_job(job.id)) + str(client.list_job_events(job.id))
        assert "x" * MAX_REASON_CHARS in seen
        assert "x" * (MAX_REASON_CHARS + 1) not in seen and "d" * (MAX_REASON_CHARS + 1) not in seen
