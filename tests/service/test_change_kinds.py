"""A generation's kind is what its caller says the change is, never what a
member's words say: reasons that quote other kinds' words, sent over real gRPC
to a real coordinator on etcd, leave the recorded kind (and so the failure
counts) as the change made it."""

from __future__ import annotations

import pytest

from springback.v1 import job_service_pb2 as js
from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as ws

pytestmark = pytest.mark.timeout(60)

OTHER_KINDS_WORDS = ("m-9 joined (127.0.0.1, 1 ranks); admitted m-9; m-9 draining: spot; "
                     "m-9 left: done; lost m-9 (liveness timeout); lost m-9 (peers: reset); "
                     "m-9 reported a failure; controls.stop: loss: paused; cancelled; "
                     "scaled to min 1, max 1; created; initial plan")
"""A member's text that says every other kind's words (what reasons once
were matched against)."""


def _join(workers, job_id: str, port: int) -> str:
    return workers.JoinJob(ws.JoinJobRequest(job_id=job_id, host="127.0.0.1",
                                             rendezvous_port=port, num_local_ranks=1),
                           timeout=10).member.id


def _running(coordinator, client, workers, make_spec, port: int) -> tuple[str, str, str, int]:
    """A job of two members whose generation started: (job, a, b, generation).
    Its checkpoint interval is auto: each RUN plan's event shows the failures
    its interval was chosen from."""
    job = client.create_job(make_spec(min_workers=1, max_workers=2, checkpoint={
        "uri": "/tmp/springback-change-kinds", "every_steps": "auto"}))
    a, b = _join(workers, job.id, port), _join(workers, job.id, port + 1)
    plan = coordinator.coordinator.current_plan(job.id)
    assert plan.world_size == 2, plan
    workers.ReportStep(ws.ReportStepRequest(
        job_id=job.id, member_id=a, generation=plan.generation, step=0,
        generation_start=True, restored_from=pb.RESTORE_KIND_PEERS), timeout=5)
    return job.id, a, b, plan.generation


def _newest(client, job_id: str, generation: int | None = None) -> js.GenerationEvent:
    """The job's newest generation event (which must be `generation`, if given)."""
    _, events = client.list_job_events(job_id)
    assert generation is None or events[-1].generation == generation, events
    return events[-1]


class TestAMembersWordsDoNotDecideTheKind:
    def test_a_failure_report_saying_joined_drain_or_control_records_a_rank_failure(
            self, coordinator, client, workers, make_spec):
        job_id, a, _, generation = _running(coordinator, client, workers, make_spec, 9301)
        response = workers.ReportFailure(ws.ReportFailureRequest(
            job_id=job_id, member_id=a, generation=generation, reason=OTHER_KINDS_WORDS),
            timeout=5)
        event = _newest(client, job_id, response.generation)
        assert response.generation == generation + 1
        assert OTHER_KINDS_WORDS in event.reason  # the member's words are still shown
        assert event.kind == js.CHANGE_KIND_RANK_FAILURE, event
        assert event.checkpoint_interval.failures == 1, event  # counted as what it is

    def test_a_live_ranks_break_saying_a_failure_is_no_failure(
            self, coordinator, client, workers, make_spec):
        job_id, a, _, generation = _running(coordinator, client, workers, make_spec, 9311)
        response = workers.ReportFailure(ws.ReportFailureRequest(
            job_id=job_id, member_id=a, generation=generation, state_kept=True,
            reason=f"{a} reported a failure: lost m-9 (liveness timeout)"), timeout=5)
        event = _newest(client, job_id, response.generation)
        assert event.kind == js.CHANGE_KIND_OTHER, event
        assert event.checkpoint_interval.failures == 0, event

    def test_a_leave_and_a_drain_saying_a_failure_record_what_they_are(
            self, coordinator, client, workers, make_spec):
        job_id, a, b, generation = _running(coordinator, client, workers, make_spec, 9321)
        workers.DrainMember(ws.DrainMemberRequest(
            job_id=job_id, member_id=b, reason="m-9 reported a failure; controls.stop: x"),
            timeout=10)
        drained = _newest(client, job_id, generation + 1)
        assert drained.kind == js.CHANGE_KIND_DRAIN, drained
        assert drained.checkpoint_interval.failures == 0, drained
        workers.LeaveJob(ws.LeaveJobRequest(
            job_id=job_id, member_id=a, reason="m-9 reported a failure (liveness timeout)"),
            timeout=10)
        left = _newest(client, job_id)
        assert left.generation > drained.generation and a not in left.members, left
        assert left.kind == js.CHANGE_KIND_LEAVE, left

    def test_a_preempted_drain_and_leave_record_a_preemption_not_a_failure(
            self, coordinator, client, workers, make_spec):
        """What an agent sends when Slurm's SIGTERM (or a preemption notice)
        drains it: the kind comes from the flag, whatever the reason says."""
        job_id, a, b, generation = _running(coordinator, client, workers, make_spec, 9331)
        workers.DrainMember(ws.DrainMemberRequest(
            job_id=job_id, member_id=b, reason="lost m-9 (liveness timeout)", preempted=True),
            timeout=10)
        drained = _newest(client, job_id, generation + 1)
        assert drained.kind == js.CHANGE_KIND_PREEMPTED, drained
        assert drained.checkpoint_interval.failures == 0, drained  # planned, not a failure
        workers.LeaveJob(ws.LeaveJobRequest(
            job_id=job_id, member_id=a, reason="drained", preempted=True), timeout=10)
        left = _newest(client, job_id)
        assert left.generation > drained.generation and a not in left.members, left
        assert left.kind == js.CHANGE_KIND_PREEMPTED, left
