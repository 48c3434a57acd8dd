"""Checkpoint commits: every check inside the etcd transaction, one ref per step."""

from __future__ import annotations

import threading

import grpc
import pytest

from agentsim import join
from sbtest import wait_for
from springback.service.etcd import keys
from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as ws

pytestmark = pytest.mark.timeout(60)


def commit(workers, job_id: str, member_id: str, generation: int, step: int, uri: str):
    return workers.CommitCheckpoint(ws.CommitCheckpointRequest(
        job_id=job_id, member_id=member_id, generation=generation,
        checkpoint=pb.CheckpointRef(step=step, uri=uri, world_size=1)), timeout=10)


def generation_of(coordinator, job_id: str) -> int:
    return coordinator.coordinator.current_plan(job_id).generation


class TestOneRecordPerStep:
    def test_concurrent_commits_of_one_step_in_one_generation_only_one_is_acknowledged(
        self, coordinator, client, workers, make_spec
    ):
        job = client.create_job(make_spec(max_workers=1, checkpoint={"uri": "file:///tmp/c1"}))
        a = join(workers, job.id, 9501)
        generation = generation_of(coordinator, job.id)
        uris = [f"file:///tmp/c1/{job.id}/step-10-writer{i}" for i in range(4)]
        acknowledged, refused = [], []
        start = threading.Barrier(len(uris))

        def attempt(uri: str) -> None:
            start.wait()
            try:
                commit(workers, job.id, a, generation, 10, uri)
                acknowledged.append(uri)
            except grpc.RpcError as e:
                refused.append(e.code())

        threads = [threading.Thread(target=attempt, args=(uri,)) for uri in uris]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert len(acknowledged) == 1, acknowledged
        assert set(refused) <= {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED}
        (recorded,) = client.list_checkpoints(job.id)
        assert recorded.uri == acknowledged[0]  # the acknowledged one is the record
        assert client.get_job(job.id).status.last_checkpoint.uri == acknowledged[0]
        # A second commit of the step, later, is refused naming the one that stands.
        with pytest.raises(grpc.RpcError) as e:
            commit(workers, job.id, a, generation, 10, f"file:///tmp/c1/{job.id}/step-10-late")
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert acknowledged[0] in e.value.details()

    def test_a_retried_commit_is_acknowledged_again_and_changes_nothing(
        self, coordinator, client, workers, make_spec
    ):
        job = client.create_job(make_spec(max_workers=1, checkpoint={"uri": "file:///tmp/c2"}))
        a = join(workers, job.id, 9502)
        generation = generation_of(coordinator, job.id)
        first = commit(workers, job.id, a, generation, 10, f"file:///tmp/c2/{job.id}/step-10")
        again = commit(workers, job.id, a, generation, 10, f"file:///tmp/c2/{job.id}/step-10")
        assert list(again.retained) == list(first.retained)

    def test_a_step_recommitted_by_a_later_generation_replaces_the_damaged_record(
        self, coordinator, client, workers, make_spec
    ):
        job = client.create_job(make_spec(max_workers=2, checkpoint={"uri": "file:///tmp/c3"}))
        a = join(workers, job.id, 9503)
        old_generation = generation_of(coordinator, job.id)
        commit(workers, job.id, a, old_generation, 5, f"file:///tmp/c3/{job.id}/step-5-g1")
        commit(workers, job.id, a, old_generation, 10, f"file:///tmp/c3/{job.id}/step-10-g1")
        # The step-10 copy turns out damaged; training restores 5 and re-reaches 10.
        join(workers, job.id, 9504)
        generation = generation_of(coordinator, job.id)
        assert generation > old_generation
        response = commit(workers, job.id, a, generation, 10, f"file:///tmp/c3/{job.id}/step-10-g2")
        assert [r.uri for r in response.retained] == [f"file:///tmp/c3/{job.id}/step-5-g1",
                                                      f"file:///tmp/c3/{job.id}/step-10-g2"]
        assert {c.step: (c.uri, c.generation) for c in client.list_checkpoints(job.id)} == {
            5: (f"file:///tmp/c3/{job.id}/step-5-g1", old_generation),
            10: (f"file:///tmp/c3/{job.id}/step-10-g2", generation),
        }
        assert client.get_job(job.id).status.last_checkpoint.uri == f"file:///tmp/c3/{job.id}/step-10-g2"


def report_start(workers, job_id: str, member_id: str, generation: int, step: int) -> None:
    workers.ReportStep(ws.ReportStepRequest(
        job_id=job_id, member_id=member_id, generation=generation, step=step,
        generation_start=True, restored_from=pb.RESTORE_KIND_PEERS), timeout=10)


class TestEarlierGenerations:
    def test_a_commit_of_an_earlier_generation_counts_until_a_later_generation_starts(
        self, coordinator, client, workers, make_spec
    ):
        # Every node draining at once: each drain makes a generation that no
        # rank starts while the last holders write the drain checkpoint in
        # the generation they trained in. Its commit holds the newest state
        # until a later generation's ranks agree on one; then it is stale.
        job = client.create_job(make_spec(max_workers=2, checkpoint={"uri": "file:///tmp/c8"}))
        a = join(workers, job.id, 9511)
        trained = generation_of(coordinator, job.id)
        report_start(workers, job.id, a, trained, 0)
        b = join(workers, job.id, 9512)
        later = generation_of(coordinator, job.id)
        assert later > trained
        commit(workers, job.id, a, trained, 5, f"file:///tmp/c8/{job.id}/step-5")
        assert client.get_job(job.id).status.last_checkpoint.step == 5
        report_start(workers, job.id, b, later, 5)
        with pytest.raises(grpc.RpcError) as e:
            commit(workers, job.id, a, trained, 6, f"file:///tmp/c8/{job.id}/step-6")
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert [(c.step, c.generation) for c in client.list_checkpoints(job.id)] == [(5, trained)]


class TestPausedJobs:
    def test_a_commit_after_a_pause_keeps_the_message_that_says_why_it_paused(
        self, coordinator, client, workers, make_spec
    ):
        # A checkpoint in flight when a stop rule pauses the job commits after
        # the pause; the job's message must still say why it paused.
        job = client.create_job(make_spec(max_workers=1, checkpoint={"uri": "file:///tmp/c9"}))
        a = join(workers, job.id, 9521)
        generation = generation_of(coordinator, job.id)
        report_start(workers, job.id, a, generation, 0)
        paused = client.pause_job(job.id).status
        assert paused.state == pb.JOB_STATE_PAUSED and paused.message
        commit(workers, job.id, a, generation_of(coordinator, job.id), 5,
               f"file:///tmp/c9/{job.id}/step-5")
        status = client.get_job(job.id).status
        assert status.last_checkpoint.step == 5
        assert (status.state, status.message) == (pb.JOB_STATE_PAUSED, paused.message)
        resumed = client.resume_job(job.id).status  # resumed: the message moves on
        assert resumed.state != pb.JOB_STATE_PAUSED and resumed.message != paused.message


class TestFencedMembers:
    def test_an_expired_member_is_refused_before_its_expiry_is_replanned(
        self, coordinator, client, workers, make_spec
    ):
        # Reconcile off: the expiry is not yet a new generation, as in the
        # window between a lease expiry and the leader's next reconcile pass.
        coordinator.reconciler.interval_s = 3600
        job = client.create_job(make_spec(max_workers=1, checkpoint={"uri": "file:///tmp/c4"}))
        a = join(workers, job.id, 9505)
        generation = generation_of(coordinator, job.id)
        commit(workers, job.id, a, generation, 10, f"file:///tmp/c4/{job.id}/step-10")  # caches its lease
        wait_for(lambda: coordinator.store.get(keys.member(job.id, a)) is None, 15,
                 "the member's lease to expire")
        assert generation_of(coordinator, job.id) == generation
        for call, request in (
            (workers.CommitCheckpoint, ws.CommitCheckpointRequest(
                job_id=job.id, member_id=a, generation=generation,
                checkpoint=pb.CheckpointRef(step=20, uri=f"file:///tmp/c4/{job.id}/step-20"))),
            (workers.ReportFailure, ws.ReportFailureRequest(
                job_id=job.id, member_id=a, generation=generation, reason="late")),
            (workers.ReportCheckpointError, ws.ReportCheckpointErrorRequest(
                job_id=job.id, member_id=a, generation=generation, error="late")),
        ):
            with pytest.raises(grpc.RpcError) as e:
                call(request, timeout=10)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND, call
        status = client.get_job(job.id).status
        assert [c.step for c in client.list_checkpoints(job.id)] == [10]
        assert status.generation == generation and status.checkpoint_error == ""

    def test_a_live_member_without_ranks_cannot_commit(self, coordinator, client, workers, make_spec):
        job = client.create_job(make_spec(max_workers=1, checkpoint={"uri": "file:///tmp/c5"}))
        a = join(workers, job.id, 9506)
        spare = join(workers, job.id, 9507)
        plan = coordinator.coordinator.current_plan(job.id)
        assert [m.member_id for m in plan.members] == [a] and list(plan.spares) == [spare]
        with pytest.raises(grpc.RpcError) as e:
            commit(workers, job.id, spare, plan.generation, 10, f"file:///tmp/c5/{job.id}/step-10")
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "holds no ranks" in e.value.details()
        assert client.list_checkpoints(job.id) == []


class TestConfinedToTheJobsDirectory:
    @pytest.mark.parametrize("uri", [
        "file:///etc",                                   # anywhere else
        "file:///tmp/c6/step-10",                        # the spec's URI, not the job's directory
        "file:///tmp/c6/{job}/../other-job/step-10",     # out through '..'
        "file:///tmp/c6/{job}/step-10/../../x",
        "file:///tmp/c6/{job}",                          # the directory itself
        "file:///tmp/c6/{job}/a/b",                      # not one name directly in it
        "file:///tmp/c6/{job}-other/step-10",            # a sibling sharing the prefix
    ])
    def test_a_commit_outside_the_jobs_own_directory_is_refused_and_never_recorded(
        self, coordinator, client, workers, make_spec, uri
    ):
        job = client.create_job(make_spec(max_workers=1, checkpoint={"uri": "file:///tmp/c6"}))
        a = join(workers, job.id, 9601)
        generation = generation_of(coordinator, job.id)
        with pytest.raises(grpc.RpcError) as e:
            commit(workers, job.id, a, generation, 10, uri.format(job=job.id))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "checkpoint.uri" in e.value.details() and job.id in e.value.details()
        assert client.list_checkpoints(job.id) == []
        assert not client.get_job(job.id).status.last_checkpoint.uri
        # the job's own directory is accepted
        commit(workers, job.id, a, generation, 10, f"file:///tmp/c6/{job.id}/step-00000010-g1")
        assert [c.step for c in client.list_checkpoints(job.id)] == [10]

    def test_a_job_without_a_checkpoint_uri_records_no_commit(self, coordinator, client, workers,
                                                              make_spec):
        """Nothing of such a job writes a checkpoint: any URI is a forgery."""
        job = client.create_job(make_spec(max_workers=1))
        a = join(workers, job.id, 9602)
        generation = generation_of(coordinator, job.id)
        with pytest.raises(grpc.RpcError) as e:
            commit(workers, job.id, a, generation, 10, f"file:///tmp/{job.id}/step-00000010-g1")
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "has no checkpoint.uri" in e.value.details() and job.id in e.value.details()
        assert client.list_checkpoints(job.id) == []
        assert not client.get_job(job.id).status.last_checkpoint.uri

    def test_a_spec_whose_checkpoint_uri_climbs_out_is_refused_naming_the_field(self, client,
                                                                               make_spec):
        with pytest.raises(Exception) as e:
            client.create_job(make_spec(checkpoint={"uri": "file:///x/../../etc"}))
        assert "checkpoint.uri" in str(e.value) and "'..'" in str(e.value)
        assert client.list_jobs() == []
