"""Restart mode's progress relay keeps the generation-start report until the
coordinator has it: a lost report would leave the job's restores and steps
redone untold (a restart that looked like a fresh run)."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from sbtest import wait_for
from springback.client.workers import MemberCalls
from springback.storage.resume import Progress, write_progress
from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as ws
from springback.v1 import worker_service_pb2_grpc as ws_grpc
from springback.worker.agent.restart import RestartRanks

pytestmark = pytest.mark.timeout(60)


class LoseFirstStartReport(grpc.UnaryUnaryClientInterceptor):
    """The link drops the first generation-start ReportStep (UNAVAILABLE
    before it reaches the coordinator), as a reset connection would."""

    def __init__(self) -> None:
        self.lost = 0

    def intercept_unary_unary(self, continuation, details, request):  # noqa: ANN001, ANN201
        if getattr(request, "generation_start", False) and not self.lost:
            self.lost += 1
            raise LostCall()
        return continuation(details, request)


class LostCall(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection reset (injected)"


def test_a_lost_generation_start_report_is_sent_again(start_coordinator, make_spec, tmp_path):
    coordinator = start_coordinator(liveness_timeout_s=60.0)  # no heartbeats in this test
    wait_for(coordinator.election.is_leader, 10, "the coordinator to lead")
    channel = grpc.insecure_channel(coordinator.address)
    lossy = LoseFirstStartReport()
    stub = ws_grpc.WorkerServiceStub(grpc.intercept_channel(channel, lossy))
    from springback.client.api import Client

    with Client(coordinator.address) as client:
        job = client.create_job(make_spec(max_workers=1, max_steps=100))
        member = ws_grpc.WorkerServiceStub(channel).JoinJob(ws.JoinJobRequest(
            job_id=job.id, host="127.0.0.1", rendezvous_port=1, num_local_ranks=1),
            timeout=10).member
        running = wait_for(lambda: (s := client.get_job(job.id).status).state
                           == pb.JOB_STATE_RUNNING and s, 20, "the job to run")
        plan = pb.Plan(job_id=job.id, generation=running.generation, action=pb.PLAN_ACTION_RUN,
                       spec=job.spec, members=[pb.PlanMember(member_id=member.id, first_rank=0,
                                                             num_local_ranks=1)])
        port = SimpleNamespace(  # the part of runner.AgentPort the relay uses
            config=SimpleNamespace(job_id=job.id, host="127.0.0.1", command=["train.py"],
                                   fork_server=False),
            member_id=lambda: member.id, calls=lambda: MemberCalls(stub, job.id, member.id),
            plan=lambda: plan,
            control_dir=lambda: str(tmp_path))
        ranks = RestartRanks(port, rendezvous=SimpleNamespace(get=lambda: None))  # type: ignore[arg-type]
        ranks.generation, ranks._me = plan.generation, plan.members[0]
        # rank 0 of this generation restored the commit of step 10
        write_progress(str(tmp_path), Progress(generation=plan.generation, step=12,
                                               restored_step=10))

        ranks._relay(final=True)
        assert lossy.lost == 1
        told = client.get_job(job.id).status
        assert (told.num_restores, told.step) == (0, 0)  # nothing of this generation counted

        ranks._relay(final=True)
        told = client.get_job(job.id).status
        assert told.num_restores == 1
        assert told.step == 12
