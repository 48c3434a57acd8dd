"""A layout the live members cannot satisfy: the job waits and says why."""

from __future__ import annotations

import grpc
import pytest

from sbtest import wait_for
from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as ws
from springback.v1 import worker_service_pb2_grpc as ws_grpc

pytestmark = pytest.mark.timeout(60)


def test_a_shard_degree_no_live_world_fits_waits_with_a_message_naming_the_field(
        coordinator, client, make_spec):
    job = client.create_job(make_spec(min_workers=1, max_workers=2, layout={"shard": 4}))
    with grpc.insecure_channel(coordinator.address) as channel:
        workers = ws_grpc.WorkerServiceStub(channel)
        workers.JoinJob(ws.JoinJobRequest(job_id=job.id, host="127.0.0.1", rendezvous_port=9801,
                                          num_local_ranks=2, join_token="a"), timeout=10)
        status = wait_for(lambda: (s := client.get_job(job.id).status).generation and s, 10,
                          "a plan for the joined member")
        assert status.state == pb.JOB_STATE_PENDING
        assert "layout.shard = 4" in status.message, status.message
        workers.JoinJob(ws.JoinJobRequest(job_id=job.id, host="127.0.0.1", rendezvous_port=9802,
                                          num_local_ranks=2, join_token="b"), timeout=10)
        running = wait_for(lambda: (s := client.get_job(job.id).status).state
                           == pb.JOB_STATE_RUNNING and s, 10, "the 4-rank world to run")
        assert running.world_size == 4 and "layout" not in running.message
