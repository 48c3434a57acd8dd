"""The agent's JoinJob retries (worker/agent/startup.py `join_job`) against a
real gRPC server on loopback that fails the first attempts as a loaded
replica set does."""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest

from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as wpb
from springback.v1 import worker_service_pb2_grpc as wgrpc
from springback.worker.agent.startup import DrainedBeforeJoin, join_job

pytestmark = pytest.mark.timeout(30)


class ScriptedJoins(wgrpc.WorkerServiceServicer):
    """Answers JoinJob with the scripted failures first, then with a member."""

    def __init__(self, failures: list[grpc.StatusCode]) -> None:
        self.failures = list(failures)
        self.tokens: list[str] = []

    def JoinJob(self, request, context):  # noqa: ANN001, N802 - gRPC's names
        self.tokens.append(request.join_token)
        if self.failures:
            context.abort(self.failures.pop(0), "scripted")
        return wpb.JoinJobResponse(member=pb.Member(id="m-1", job_id=request.job_id))


@pytest.fixture
def serve():
    servers, channels = [], []

    def start(servicer: ScriptedJoins) -> wgrpc.WorkerServiceStub:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        wgrpc.add_WorkerServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        channels.append(grpc.insecure_channel(f"127.0.0.1:{port}"))
        return wgrpc.WorkerServiceStub(channels[-1])

    yield start
    for channel in channels:
        channel.close()
    for server in servers:
        server.stop(None)


def request() -> wpb.JoinJobRequest:
    return wpb.JoinJobRequest(job_id="j", host="127.0.0.1", rendezvous_port=1,
                              num_local_ranks=1, join_token="t-1")


def test_a_dropped_connection_a_full_replica_and_a_late_answer_are_retried_with_one_token(serve):
    codes = [grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE]
    servicer = ScriptedJoins(codes)
    response = join_job(serve(servicer), request(), deadline=time.monotonic() + 20,
                        attempt_timeout_s=5, drain_reason=lambda: None)
    assert response.member.id == "m-1"
    assert servicer.tokens == ["t-1"] * 5  # one member, however many attempts


def test_a_permanent_failure_is_raised_at_once(serve):
    servicer = ScriptedJoins([grpc.StatusCode.NOT_FOUND])
    with pytest.raises(grpc.RpcError) as e:
        join_job(serve(servicer), request(), deadline=time.monotonic() + 20,
                 attempt_timeout_s=5, drain_reason=lambda: None)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and len(servicer.tokens) == 1


def test_a_drain_between_attempts_ends_the_join(serve):
    servicer = ScriptedJoins([grpc.StatusCode.CANCELLED] * 3)
    with pytest.raises(DrainedBeforeJoin, match="spot notice"):
        join_job(serve(servicer), request(), deadline=time.monotonic() + 20,
                 attempt_timeout_s=5, drain_reason=lambda: "spot notice")
    assert len(servicer.tokens) == 1


def test_past_the_deadline_the_last_failure_is_raised(serve):
    servicer = ScriptedJoins([grpc.StatusCode.UNAVAILABLE] * 100)
    with pytest.raises(grpc.RpcError) as e:
        join_job(serve(servicer), request(), deadline=time.monotonic(),
                 attempt_timeout_s=5, drain_reason=lambda: None)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and len(servicer.tokens) == 1
