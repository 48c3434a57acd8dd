"""Thin gRPC servicers: convert the request, call the logic, convert back.

Domain errors become status codes in one place (`_handle`); anything else is
logged and becomes INTERNAL. Streams end with UNAVAILABLE when this replica
stops leading, so clients reconnect to the new leader.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
from google.protobuf.duration_pb2 import Duration

from springback.service.commits import Commits
from springback.service.coordinator import Coordinator
from springback.client.errors import SpringbackError, grpc_code
from springback.service.history import delete_job
from springback.service.jobs import JobControl
from springback.service.liveness import EtcdReachability
from springback.service.membership import Membership
from springback.service.planner import Progress
from springback.v1 import job_service_pb2 as js
from springback.v1 import job_service_pb2_grpc as js_grpc
from springback.v1 import worker_service_pb2 as ws
from springback.v1 import worker_service_pb2_grpc as ws_grpc

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


def _abort(context: grpc.ServicerContext, error: BaseException) -> None:
    if isinstance(error, SpringbackError):
        context.abort(grpc_code(error), str(error))
    log.exception("internal error")
    context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}")


def _handle(fn: F) -> F:
    @functools.wraps(fn)
    def unary(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(self, request, context)
        except Exception as e:  # noqa: BLE001 (mapped to a status, never swallowed)
            _abort(context, e)

    return unary  # type: ignore[return-value]


def _handle_stream(fn: F) -> F:
    @functools.wraps(fn)
    def stream(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from fn(self, request, context)
        except Exception as e:  # noqa: BLE001
            _abort(context, e)

    return stream  # type: ignore[return-value]


class JobServicer(js_grpc.JobServiceServicer):
    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.jobs = JobControl(coordinator)

    @_handle
    def CreateJob(self, request: js.CreateJobRequest, context: grpc.ServicerContext) -> js.CreateJobResponse:
        return js.CreateJobResponse(job=self.jobs.create(request.spec))

    @_handle
    def GetJob(self, request: js.GetJobRequest, context: grpc.ServicerContext) -> js.GetJobResponse:
        return js.GetJobResponse(job=self.coordinator.get_job(request.job_id))

    @_handle
    def ListJobs(self, request: js.ListJobsRequest, context: grpc.ServicerContext) -> js.ListJobsResponse:
        return js.ListJobsResponse(jobs=self.coordinator.list_jobs())

    @_handle
    def ScaleJob(self, request: js.ScaleJobRequest, context: grpc.ServicerContext) -> js.ScaleJobResponse:
        job = self.jobs.scale(request.job_id, request.min_workers, request.max_workers)
        return js.ScaleJobResponse(job=job)

    @_handle
    def PauseJob(self, request: js.PauseJobRequest, context: grpc.ServicerContext) -> js.PauseJobResponse:
        return js.PauseJobResponse(job=self.jobs.pause(request.job_id))

    @_handle
    def ResumeJob(self, request: js.ResumeJobRequest, context: grpc.ServicerContext) -> js.ResumeJobResponse:
        return js.ResumeJobResponse(job=self.jobs.resume(request.job_id))

    @_handle
    def CancelJob(self, request: js.CancelJobRequest, context: grpc.ServicerContext) -> js.CancelJobResponse:
        return js.CancelJobResponse(job=self.jobs.cancel(request.job_id))

    @_handle_stream
    def WatchJob(self, request: js.WatchJobRequest,
                 context: grpc.ServicerContext) -> Iterator[js.WatchJobResponse]:
        self.coordinator.get_job(request.job_id)  # NOT_FOUND before the stream starts
        for job, event in self.coordinator.watch(request.job_id, context.is_active):
            yield js.WatchJobResponse(job=job, event=event)

    @_handle
    def ListCheckpoints(self, request: js.ListCheckpointsRequest,
                        context: grpc.ServicerContext) -> js.ListCheckpointsResponse:
        return js.ListCheckpointsResponse(
            checkpoints=self.coordinator.list_checkpoints(request.job_id))

    @_handle
    def RestoreJob(self, request: js.RestoreJobRequest,
                   context: grpc.ServicerContext) -> js.RestoreJobResponse:
        return js.RestoreJobResponse(job=self.jobs.restore(request.job_id, request.step))

    @_handle
    def ListJobEvents(self, request: js.ListJobEventsRequest,
                      context: grpc.ServicerContext) -> js.ListJobEventsResponse:
        job = self.coordinator.get_job(request.job_id)
        return js.ListJobEventsResponse(
            job=job, generations=self.coordinator.history.events(request.job_id))

    @_handle
    def DeleteJob(self, request: js.DeleteJobRequest,
                  context: grpc.ServicerContext) -> js.DeleteJobResponse:
        self.coordinator.require_leader()
        store = self.coordinator.store
        return js.DeleteJobResponse(
            job=delete_job(store, self.coordinator.election.fence, request.job_id))


def _duration(seconds: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


class WorkerServicer(ws_grpc.WorkerServiceServicer):
    def __init__(self, coordinator: Coordinator,
                 liveness: EtcdReachability | None = None) -> None:
        self.coordinator = coordinator
        self.membership = Membership(coordinator, liveness)
        self.commits = Commits(coordinator)

    @_handle
    def JoinJob(self, request: ws.JoinJobRequest, context: grpc.ServicerContext) -> ws.JoinJobResponse:
        member = self.membership.join(
            request.job_id, request.host, request.rendezvous_port, request.num_local_ranks,
            request.join_token)
        timeout = self.membership.liveness_timeout_s
        return ws.JoinJobResponse(
            member=member, liveness_timeout=_duration(timeout),
            heartbeat_interval=_duration(timeout / 4),
        )

    @_handle
    def Heartbeat(self, request: ws.HeartbeatRequest, context: grpc.ServicerContext) -> ws.HeartbeatResponse:
        return ws.HeartbeatResponse(
            generation=self.membership.heartbeat(request.job_id, request.member_id))

    @_handle
    def LeaveJob(self, request: ws.LeaveJobRequest, context: grpc.ServicerContext) -> ws.LeaveJobResponse:
        self.membership.leave(request.job_id, request.member_id, request.reason)
        return ws.LeaveJobResponse()

    @_handle
    def DrainMember(self, request: ws.DrainMemberRequest,
                    context: grpc.ServicerContext) -> ws.DrainMemberResponse:
        checkpoint = self.membership.drain(request.job_id, request.member_id, request.reason)
        return ws.DrainMemberResponse(checkpoint=checkpoint)

    @_handle_stream
    def WatchPlans(self, request: ws.WatchPlansRequest,
                   context: grpc.ServicerContext) -> Iterator[ws.WatchPlansResponse]:
        for plan in self.coordinator.watch_plans(request.job_id, context.is_active,
                                                 member_id=request.member_id):
            yield ws.WatchPlansResponse(plan=plan)

    @_handle
    def ReportStep(self, request: ws.ReportStepRequest,
                   context: grpc.ServicerContext) -> ws.ReportStepResponse:
        progress = Progress(step=request.step, samples_consumed=request.samples_consumed,
                            loss=request.loss, cursor=request.cursor)
        if request.generation_start:
            self.coordinator.record_generation_start(
                request.job_id, request.member_id, request.generation, progress,
                request.restored_from)
            return ws.ReportStepResponse(
                generation=self.coordinator.current_generation(request.job_id))
        generation = self.coordinator.record_progress(
            request.job_id, request.member_id, request.generation, progress)
        return ws.ReportStepResponse(generation=generation)

    @_handle
    def ReportFailure(self, request: ws.ReportFailureRequest,
                      context: grpc.ServicerContext) -> ws.ReportFailureResponse:
        generation = self.membership.report_failure(
            request.job_id, request.member_id, request.generation, request.reason)
        return ws.ReportFailureResponse(generation=generation)

    @_handle
    def CommitCheckpoint(self, request: ws.CommitCheckpointRequest,
                         context: grpc.ServicerContext) -> ws.CommitCheckpointResponse:
        retained = self.commits.commit(
            request.job_id, request.member_id, request.generation, request.checkpoint)
        return ws.CommitCheckpointResponse(retained=retained)

    @_handle
    def ReportCheckpointError(self, request: ws.ReportCheckpointErrorRequest,
                              context: grpc.ServicerContext) -> ws.ReportCheckpointErrorResponse:
        self.commits.report_error(request.job_id, request.member_id, request.generation, request.error)
        return ws.ReportCheckpointErrorResponse()
