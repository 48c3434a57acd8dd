"""Thin gRPC servicers: convert the request, call the logic, convert back.

Domain errors become status codes in one place (`_handle`); anything else is
logged and becomes INTERNAL. Unary calls and WatchJob run on the server's
worker threads; WatchPlans runs on its asyncio loop (`planstreams`, no thread
per stream). WatchJob ends with UNAVAILABLE when this replica stops leading,
so clients reconnect to the new leader; plan streams are served by every
replica and survive a change of leader.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent import futures
from typing import Any, TypeVar

import grpc
from google.protobuf.duration_pb2 import Duration

from springback.service.core.commits import Commits
from springback.service.core.coordinator import Coordinator
from springback.client.errors import (
    FailedPrecondition, InvalidArgument, SpringbackError, grpc_code,
)
from springback.service.core import reports
from springback.service.core import rankpause
from springback.service.transport import streamnotes
from springback.service.core.evidence import PeerLossEvidence
from springback.service.transport.streamnotes import StreamNotes
from springback.service.transport.heartbeats import Heartbeats
from springback.service.transport.interceptors import in_thread
from springback.service.core.jobs import JobControl
from springback.service.etcd.liveness import EtcdReachability
from springback.service.core.membership import Membership
from springback.service.policy.planner import Progress
from springback.service.transport.planstreams import PlanStreams
from springback.v1 import job_service_pb2 as js
from springback.v1 import job_service_pb2_grpc as js_grpc
from springback.v1 import worker_service_pb2 as ws
from springback.v1 import worker_service_pb2_grpc as ws_grpc

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

MAX_REASON_CHARS = 1024
"""Free text from members (leave, drain, failure and checkpoint-error
reasons, a generation start's ``state_lost``) is cut to this many characters
before it reaches etcd, job status or logs, so a member cannot fill them."""
MAX_URI_CHARS = 4096
"""A committed checkpoint's URI longer than this is INVALID_ARGUMENT (a URI
cannot be cut)."""


def member_text(text: str) -> str:
    """`text` with its control and other unprintable characters escaped
    (``\\n``, ``\\x1b``), cut to `MAX_REASON_CHARS`: a member's newline
    cannot forge a line in the coordinator's log, nor an escape sequence
    reach an operator's terminal through a job message."""
    if len(text) <= MAX_REASON_CHARS and text.isprintable():
        return text
    text = text[:MAX_REASON_CHARS]  # escaping only lengthens: cut first, then again
    escaped = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                      for c in text)
    return escaped[:MAX_REASON_CHARS]


JOIN_PLAN_WAIT_S = 5.0
"""Longest JoinJob waits for the plan that places the new member."""
JOIN_PLAN_WAITERS = 64
"""At most this many JoinJob calls wait for their plan at once on a replica.
More than that is a join storm: later joins are answered as soon as they are
registered, and their plan streams bring the plan (a waiting join holds a
worker thread on the replica that forwarded it, and waits up to
`JOIN_PLAN_WAIT_S` for a generation the storm's settle window may delay)."""


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


class JobServicer(js_grpc.JobServiceServicer):
    def __init__(self, coordinator: Coordinator, stream_pool: futures.ThreadPoolExecutor,
                 issue_join: Callable[[str], str] | None = None) -> None:
        """`issue_join(job_id)`: a job's join credential (`credentials.issue_join`
        with the coordinator's token; None without a token)."""
        self.coordinator = coordinator
        self.stream_pool = stream_pool
        self.issue_join = issue_join
        self.jobs = JobControl(coordinator)

    @_handle
    def CreateJob(self, request: js.CreateJobRequest, context: grpc.ServicerContext) -> js.CreateJobResponse:
        return js.CreateJobResponse(job=self.jobs.create(request.spec))

    @_handle
    def GetJob(self, request: js.GetJobRequest, context: grpc.ServicerContext) -> js.GetJobResponse:
        return js.GetJobResponse(job=self.coordinator.get_job(request.job_id))

    @_handle
    def IssueJoinCredential(self, request: js.IssueJoinCredentialRequest,
                            context: grpc.ServicerContext) -> js.IssueJoinCredentialResponse:
        if self.issue_join is None:
            raise FailedPrecondition("this coordinator has no --token: join credentials are "
                                     "keyed by it (agents use their client certificates)")
        self.coordinator.get_job(request.job_id)  # NotFound for an unknown job
        return js.IssueJoinCredentialResponse(credential=self.issue_join(request.job_id))

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

    async def WatchJob(self, request: js.WatchJobRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[js.WatchJobResponse]:
        """The leader's job watch (`Coordinator.watch`), read on a thread of the
        stream pool and sent from the loop; ends within a second of the call."""
        closed = threading.Event()
        try:
            await asyncio.to_thread(self.coordinator.get_job, request.job_id)  # NOT_FOUND first
            changes = self.coordinator.watch(request.job_id, lambda: not closed.is_set())
            async for job, event in in_thread(self.stream_pool, changes):
                yield js.WatchJobResponse(job=job, event=event)
        except SpringbackError as e:
            await context.abort(grpc_code(e), str(e))
        finally:
            closed.set()

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
        return js.DeleteJobResponse(job=self.coordinator.delete_job(request.job_id))


def _duration(seconds: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


class WorkerServicer(ws_grpc.WorkerServiceServicer):
    def __init__(self, coordinator: Coordinator,
                 liveness: EtcdReachability | None = None,
                 plan_streams: PlanStreams | None = None,
                 heartbeats: Heartbeats | None = None,
                 stream_notes: StreamNotes | None = None,
                 issue_credential: Callable[[str, str, int], str] | None = None) -> None:
        """`issue_credential(job_id, member_id, lease_id)`: the member credential
        `JoinJob` hands out (`credentials.issue` with the coordinator's token;
        None without a token: no credential)."""
        self.coordinator = coordinator
        self.issue_credential = issue_credential
        self.membership = Membership(coordinator, liveness)
        self.evidence = stream_notes.evidence if stream_notes else PeerLossEvidence(coordinator)
        self.stream_notes = stream_notes
        self.commits = Commits(coordinator)
        self.plan_streams = plan_streams
        self.heartbeats = heartbeats
        self.num_join_waiters = 0  # JoinJob calls waiting for their plan (on the loop)

    async def JoinJob(self, request: ws.JoinJobRequest,
                      context: grpc.aio.ServicerContext) -> ws.JoinJobResponse:
        """Registers the member on a worker thread, then waits on the loop (no
        thread) for the settled plan that places it, up to `JOIN_PLAN_WAIT_S`
        (or the call's deadline): the answer comes once the member is planned
        or the planner left it out; past the wait it is registered anyway and
        its plan stream brings the plan. In a join storm (more than
        `JOIN_PLAN_WAITERS` joins waiting here) it answers once registered."""
        try:
            member, lease_id = await asyncio.to_thread(
                self.membership.join, request.job_id, request.host, request.rendezvous_port,
                request.num_local_ranks, request.join_token)
        except SpringbackError as e:
            await context.abort(grpc_code(e), str(e))
        if self.plan_streams is not None and self.num_join_waiters < JOIN_PLAN_WAITERS:
            remaining = context.time_remaining()
            wait = JOIN_PLAN_WAIT_S if remaining is None else min(JOIN_PLAN_WAIT_S, remaining - 0.5)
            self.num_join_waiters += 1
            try:
                await self.plan_streams.until_planned(request.job_id, member.id, wait)
            finally:
                self.num_join_waiters -= 1
        timeout = self.membership.liveness_timeout_s
        interval = self.heartbeats.pacer.interval_s() if self.heartbeats else timeout / 4
        return ws.JoinJobResponse(
            member=member, liveness_timeout=_duration(timeout),
            heartbeat_interval=_duration(interval),
            member_credential=(self.issue_credential(request.job_id, member.id, lease_id)
                               if self.issue_credential is not None else ""),
        )

    async def Heartbeat(self, request: ws.HeartbeatRequest,
                        context: grpc.aio.ServicerContext) -> ws.HeartbeatResponse:
        """On this replica's loop, no thread (`heartbeats`); the answer names
        the interval to keep (`pacing`)."""
        if self.heartbeats is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "heartbeats need the aio server")
            raise AssertionError("abort returned")
        try:
            generation = await self.heartbeats.beat(request.job_id, request.member_id)
        except SpringbackError as e:
            await context.abort(grpc_code(e), str(e))
        return ws.HeartbeatResponse(generation=generation,
                                    heartbeat_interval=_duration(self.heartbeats.pacer.interval_s()))

    @_handle
    def LeaveJob(self, request: ws.LeaveJobRequest, context: grpc.ServicerContext) -> ws.LeaveJobResponse:
        self.membership.leave(request.job_id, request.member_id, member_text(request.reason),
                              preempted=request.preempted)
        return ws.LeaveJobResponse()

    @_handle
    def DrainMember(self, request: ws.DrainMemberRequest,
                    context: grpc.ServicerContext) -> ws.DrainMemberResponse:
        checkpoint = self.membership.drain(request.job_id, request.member_id,
                                           member_text(request.reason),
                                           preempted=request.preempted)
        return ws.DrainMemberResponse(checkpoint=checkpoint)

    async def WatchPlans(self, request: ws.WatchPlansRequest,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """Served on this replica's loop (`planstreams`); yields serialized
        responses (the handler is registered without a serializer, see `server`)."""
        if self.plan_streams is None or self.stream_notes is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "plan streams need the aio server")
            return
        by_client = False
        stream_id = self.stream_notes.opened(request.job_id, request.member_id)
        try:
            async for response in self.plan_streams.stream(request.job_id, request.member_id):
                yield response
        except (asyncio.CancelledError, GeneratorExit):
            by_client = True  # the agent's side ended it (or its process died)
            raise
        except SpringbackError as e:
            await context.abort(grpc_code(e), str(e))
        except Exception as e:  # a bug: INTERNAL, logged
            log.exception("WatchPlans failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")
        finally:
            self.stream_notes.ended(request.job_id, request.member_id, stream_id,
                                    by_client=by_client)

    @_handle
    def ReportStep(self, request: ws.ReportStepRequest,
                   context: grpc.ServicerContext) -> ws.ReportStepResponse:
        progress = Progress(step=request.step, samples_consumed=request.samples_consumed,
                            loss=request.loss, cursor=request.cursor)
        if request.generation_start:
            reports.record_generation_start(
                self.coordinator, request.job_id, request.member_id, request.generation, progress,
                request.restored_from, state_lost=member_text(request.state_lost),
                spans=(request.startup_s, request.rendezvous_s, request.transfer_s))
            return ws.ReportStepResponse(
                generation=self.coordinator.current_generation(request.job_id))
        generation = reports.record_progress(
            self.coordinator, request.job_id, request.member_id, request.generation, progress,
            checkpoint_stall_s=request.checkpoint_stall_s,
            stall_total_s=request.checkpoint_stall_total_s,
            step_quantiles=(request.step_p50_s, request.step_p90_s, request.step_p99_s),
            member_timing=request.member_timing, store_intrusion=request.store_intrusion)
        return ws.ReportStepResponse(generation=generation)

    @_handle
    def ReportFailure(self, request: ws.ReportFailureRequest,
                      context: grpc.ServicerContext) -> ws.ReportFailureResponse:
        if request.lost_peer:  # a peer's process is gone, not ours
            generation = self.evidence.reset_reported(
                request.job_id, request.member_id, request.generation, request.lost_rank)
            return ws.ReportFailureResponse(generation=generation)
        if request.job_pause:  # the ranks' own policy (controls.bad_step)
            generation = rankpause.pause_for_ranks(
                self.coordinator, request.job_id, request.member_id, request.generation,
                member_text(request.reason))
            return ws.ReportFailureResponse(generation=generation)
        generation = self.membership.report_failure(
            request.job_id, request.member_id, request.generation, member_text(request.reason),
            state_kept=request.state_kept, job_fatal=request.job_fatal,
            storage_unavailable=request.storage_unavailable)
        return ws.ReportFailureResponse(generation=generation)

    @_handle
    def ReportPlanStreams(self, request: ws.ReportPlanStreamsRequest,
                          context: grpc.ServicerContext) -> ws.ReportPlanStreamsResponse:
        """A follower's plan-stream notes (`streamnotes`); the leader only."""
        self.coordinator.require_leader()
        streamnotes.apply(self.evidence, list(request.notes))
        return ws.ReportPlanStreamsResponse()

    @_handle
    def CommitCheckpoint(self, request: ws.CommitCheckpointRequest,
                         context: grpc.ServicerContext) -> ws.CommitCheckpointResponse:
        if len(request.checkpoint.uri) > MAX_URI_CHARS:
            raise InvalidArgument("checkpoint.uri", f"longer than {MAX_URI_CHARS} characters")
        retained = self.commits.commit(
            request.job_id, request.member_id, request.generation, request.checkpoint)
        return ws.CommitCheckpointResponse(retained=retained)

    @_handle
    def ReportCheckpointError(self, request: ws.ReportCheckpointErrorRequest,
                              context: grpc.ServicerContext) -> ws.ReportCheckpointErrorResponse:
        self.commits.report_error(request.job_id, request.member_id, request.generation,
                                  member_text(request.error))
        return ws.ReportCheckpointErrorResponse()
