"""Job control: create, scale, pause, resume, cancel, restore.

Each operation is one etcd transaction through `Coordinator.change` (state
transition + replan together), so a failure at any point leaves the previous
state. Illegal transitions raise `FailedPrecondition` and change nothing.
"""

from __future__ import annotations

import uuid

from springback.client import spec as specs
from springback.service.etcd import keys
from springback.service.core.coordinator import Coordinator, timestamp_now
from springback.client.errors import Conflict, InvalidArgument, NotFound
from springback.v1 import job_service_pb2 as js
from springback.v1 import types_pb2 as pb

_LIVE = (pb.JOB_STATE_PENDING, pb.JOB_STATE_RUNNING)
_NOT_TERMINAL = _LIVE + (pb.JOB_STATE_PAUSED,)


class JobControl:
    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    def create(self, spec: pb.JobSpec) -> pb.Job:
        """Validates `spec`, stores the job (PENDING) and its first plan."""
        spec = specs.validate(spec)
        self.coordinator.require_leader()
        job = pb.Job(id=f"{spec.name}-{uuid.uuid4().hex[:6]}", spec=spec)
        job.created_at.CopyFrom(timestamp_now())
        job.status.state = pb.JOB_STATE_PENDING
        job.status.message = "created"
        job.status.updated_at.CopyFrom(job.created_at)
        if not self.coordinator.writer.create(keys.job(job.id), job.SerializeToString()):
            # Either the id exists or this replica no longer leads (the fence).
            raise Conflict(f"job {job.id} not created: the id exists or this replica lost "
                           "leadership; retry")
        return self.coordinator.change_with_retry(job.id, "created", kind=js.CHANGE_KIND_START)

    def scale(self, job_id: str, min_workers: int, max_workers: int) -> pb.Job:
        def mutate(job: pb.Job) -> None:
            self.coordinator.require_state(job, _NOT_TERMINAL, "scale")
            scaled = pb.JobSpec()
            scaled.CopyFrom(job.spec)
            scaled.min_workers = min_workers
            scaled.max_workers = max_workers
            if min_workers == 0:
                raise InvalidArgument("min_workers", "must be positive")
            if max_workers == 0:
                raise InvalidArgument("max_workers", "must be positive")
            job.spec.CopyFrom(specs.validate(scaled))

        return self.coordinator.change_with_retry(
            job_id, f"scaled to min {min_workers}, max {max_workers}", mutate,
            kind=js.CHANGE_KIND_OPERATOR)

    def _transition(self, job_id: str, action: str, allowed: tuple[int, ...],
                    done: tuple[int, ...], target: pb.JobState, event: str,
                    kind: js.ChangeKind) -> pb.Job:
        """Moves a job in `allowed` states to `target`; a job already in a `done`
        state is left as it is (the call is idempotent)."""
        def mutate(job: pb.Job) -> None:
            if job.status.state in done:
                return
            self.coordinator.require_state(job, allowed, action)
            job.status.state = target

        return self.coordinator.change_with_retry(job_id, event, mutate, kind=kind)

    def pause(self, job_id: str) -> pb.Job:
        return self._transition(job_id, "pause", _LIVE, (pb.JOB_STATE_PAUSED,),
                                pb.JOB_STATE_PAUSED, "paused", js.CHANGE_KIND_OPERATOR)

    def resume(self, job_id: str) -> pb.Job:
        return self._transition(job_id, "resume", (pb.JOB_STATE_PAUSED,), _LIVE,
                                pb.JOB_STATE_PENDING, "resumed", js.CHANGE_KIND_OPERATOR)

    def cancel(self, job_id: str) -> pb.Job:
        return self._transition(job_id, "cancel", _NOT_TERMINAL, (pb.JOB_STATE_CANCELLED,),
                                pb.JOB_STATE_CANCELLED, "cancelled", js.CHANGE_KIND_FINISH)

    def restore(self, job_id: str, step: int) -> pb.Job:
        """Makes the next generation restore the committed checkpoint at `step`.

        `step` 0 means the newest. NOT_FOUND when no such commit exists.
        """
        checkpoints = self.coordinator.list_checkpoints(job_id)
        chosen = checkpoints[0] if checkpoints and step == 0 else next(
            (c for c in checkpoints if c.step == step), None)
        if chosen is None:
            what = f"at step {step}" if step else "at all"
            raise NotFound(f"job {job_id} has no committed checkpoint {what}")

        def mutate(job: pb.Job) -> None:
            self.coordinator.require_state(job, _NOT_TERMINAL, "restore")
            job.status.restore_step = chosen.step

        return self.coordinator.change_with_retry(
            job_id, f"restore from checkpoint at step {chosen.step} requested", mutate,
            kind=js.CHANGE_KIND_OPERATOR, force_generation=True,
        )
