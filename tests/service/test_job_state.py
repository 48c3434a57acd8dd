"""The leader's in-memory state of a job (`service/core/jobstate.py`): dropped whole
on a leadership change and on the job's deletion, against a real coordinator
and etcd."""

from __future__ import annotations

import pytest

from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as ws

pytestmark = pytest.mark.timeout(60)


def _stepping_job(coordinator, client, workers, make_spec, port: int) -> str:
    """A job of one member that reported steps 1 to 3 (leader memory only)."""
    job = client.create_job(make_spec(min_workers=1, max_workers=1))
    member = workers.JoinJob(ws.JoinJobRequest(job_id=job.id, host="127.0.0.1",
                                               rendezvous_port=port, num_local_ranks=1),
                             timeout=10).member.id
    generation = coordinator.coordinator.current_plan(job.id).generation
    workers.ReportStep(ws.ReportStepRequest(
        job_id=job.id, member_id=member, generation=generation, step=0,
        generation_start=True, restored_from=pb.RESTORE_KIND_PEERS), timeout=5)
    for step in (1, 2, 3):
        workers.ReportStep(ws.ReportStepRequest(job_id=job.id, member_id=member,
                                                generation=generation, step=step, loss=1.0),
                           timeout=5)
    return job.id


class TestJobStateIsForgotten:
    def test_a_deleted_job_leaves_nothing_in_the_leaders_memory(
            self, coordinator, client, workers, make_spec):
        job_id = _stepping_job(coordinator, client, workers, make_spec, 9601)
        c = coordinator.coordinator
        assert [step for _, step, _ in c.series(job_id)] == [1, 2, 3]
        client.cancel_job(job_id)
        client.delete_job(job_id)
        assert c.series(job_id) == [] and c.history.newest_start(job_id) is None

    def test_a_leadership_change_forgets_every_job_and_the_plan_is_read_again(
            self, coordinator, client, workers, make_spec):
        job_id = _stepping_job(coordinator, client, workers, make_spec, 9611)
        c = coordinator.coordinator
        assert c.history.newest_start(job_id) is not None
        c.leadership_changed()
        assert c.series(job_id) == [] and c.history.newest_start(job_id) is None
        # the plan is read again from etcd: the job's generation is unchanged
        assert c.current_generation(job_id) == c.current_plan(job_id).generation
