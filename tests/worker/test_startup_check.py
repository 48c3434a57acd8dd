"""The agent's start-up check (worker/agent/startup.py `check_job`, issue 48)
against a real gRPC server on loopback that fails GetJob as replicas in a
join storm do: transient codes are ridden through with backoff and growing
attempt deadlines, refusals end it at once; calls are counted server-side."""

from __future__ import annotations

import logging
import threading
from concurrent import futures

import grpc
import pytest

from springback.client.channel import LOCAL_READ
from springback.v1 import job_service_pb2 as js
from springback.v1 import job_service_pb2_grpc as js_grpc
from springback.v1 import types_pb2 as pb
from springback.worker.agent.startup import CHECK_LOG_EVERY, StartupRefused, check_job


class ScriptedReads(js_grpc.JobServiceServicer):
    """Answers GetJob with the scripted failures first (`always`: forever),
    then with the job; records each call's metadata and deadline left."""

    def __init__(self, failures: list[grpc.StatusCode],
                 always: grpc.StatusCode | None = None) -> None:
        self.failures = list(failures)
        self.always = always
        self.deadlines_s: list[float] = []
        self.local_reads: list[bool] = []
        self._lock = threading.Lock()

    def GetJob(self, request, context):  # noqa: ANN001, N802 - gRPC's names
        with self._lock:
            self.deadlines_s.append(context.time_remaining())
            self.local_reads.append(LOCAL_READ in tuple(context.invocation_metadata()))
            failure = self.failures.pop(0) if self.failures else self.always
        if failure is not None:
            context.abort(failure, "scripted")
        return js.GetJobResponse(job=pb.Job(id=request.job_id, spec=pb.JobSpec(
            min_workers=1, max_workers=2), status=pb.JobStatus(state=pb.JOB_STATE_RUNNING)))


@pytest.fixture
def serve():
    servers, channels = [], []

    def start(servicer: ScriptedReads) -> grpc.Channel:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        js_grpc.add_JobServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        channels.append(grpc.insecure_channel(f"127.0.0.1:{port}"))
        return channels[-1]

    yield start
    for channel in channels:
        channel.close()
    for server in servers:
        server.stop(None)


def check(channel: grpc.Channel, connect_timeout_s: float) -> pb.Job:
    return check_job(channel, job_id="j", target="replicas", connect_timeout_s=connect_timeout_s,
                     nnodes=(1, 2), drain_reason=lambda: None)


class TestTheStartUpCheckInAStorm:
    @pytest.mark.timeout(60)
    def test_dropped_connections_and_late_answers_are_ridden_through(self, serve):
        codes = [grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
                 grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE]
        servicer = ScriptedReads(codes)
        assert check(serve(servicer), connect_timeout_s=40).id == "j"
        assert len(servicer.deadlines_s) == 5 and all(servicer.local_reads)
        # each attempt waits longer for its answer: 2 s, 4 s, 8 s, 16 s, 16 s
        assert [round(d) for d in servicer.deadlines_s] == [2, 4, 8, 16, 16]

    @pytest.mark.timeout(30)
    def test_a_refusal_ends_it_at_once_with_the_status(self, serve):
        servicer = ScriptedReads([grpc.StatusCode.PERMISSION_DENIED])
        with pytest.raises(StartupRefused, match="PERMISSION_DENIED: scripted"):
            check(serve(servicer), connect_timeout_s=20)
        assert len(servicer.deadlines_s) == 1

    @pytest.mark.timeout(30)
    def test_retries_back_off_and_log_one_line_per_few_within_the_connect_timeout(
            self, serve, caplog):
        servicer = ScriptedReads([], always=grpc.StatusCode.CANCELLED)
        with caplog.at_level(logging.WARNING, logger="springback.agent"):
            with pytest.raises(StartupRefused, match="no coordinator answered.*CANCELLED"):
                check(serve(servicer), connect_timeout_s=3)
        calls = len(servicer.deadlines_s)
        # retried at once, an instant refusal is asked again thousands of times in 3 s;
        # with full jitter, 12 attempts fit in 3 s with a probability under 1e-4
        assert 3 <= calls <= 12, calls
        lines = [r for r in caplog.records if "not answering" in r.getMessage()]
        assert 1 <= len(lines) <= -(-calls // CHECK_LOG_EVERY), (len(lines), calls)
        # no attempt's deadline reaches past the connect timeout
        assert all(d <= 3.0 for d in servicer.deadlines_s)
