"""A job paused by its own ranks (spec ``controls.bad_step``): rank 0 reports
that the ranks agreed the job must pause (``ReportFailureRequest.job_pause``,
`worker/train/badstep.py`), and the leader pauses it with the ranks' reason
as its message and a CONTROL generation event (docs/controls.md). The ranks
own the message whole, its ``controls.bad_step: `` prefix included
(`badstep.BadSteps.record`, the same text a standalone run raises as
`BadStepLimit`): the leader adds nothing to it."""

from __future__ import annotations

import logging

from springback.service.core import fencing
from springback.service.core.coordinator import Coordinator
from springback.v1 import job_service_pb2 as js
from springback.v1 import types_pb2 as pb

log = logging.getLogger(__name__)


def pause_for_ranks(coordinator: Coordinator, job_id: str, member_id: str, generation: int,
                    reason: str) -> int:
    """Pauses the RUNNING job `job_id` on `member_id`'s report of
    `generation`, `reason` its message; the member keeps its state, so
    `springback job resume` goes on from it. Fenced as every member report
    (`fencing.change_as_member`: a stale generation is FAILED_PRECONDITION, an
    expired member NOT_FOUND; not the leader: `NotLeader`). A job that is not
    running (paused meanwhile, waiting, ended) is left as it is and nothing
    is written: the call is idempotent. Returns the job's generation."""
    coordinator.require_leader()
    current = coordinator.get_job(job_id)
    if current.status.state != pb.JOB_STATE_RUNNING:
        fencing.report_fence(coordinator, job_id, member_id, generation, older=True)
        return current.status.generation

    def pause(job: pb.Job) -> None:
        if job.status.state == pb.JOB_STATE_RUNNING:
            job.status.state = pb.JOB_STATE_PAUSED

    job = fencing.change_as_member(coordinator, job_id, member_id, generation, reason, pause,
                                   kind=js.CHANGE_KIND_CONTROL, older=True)
    log.warning("job %s: %s", job_id, reason)
    return job.status.generation
