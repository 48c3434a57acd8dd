"""Job history through the CLI (`job events`, `job watch` of a finished job,
`job delete`) against a real coordinator and real node agents."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cluster import AgentProcess
from sbtest import wait_for
from springback.service.core.history import History, change_kind
from springback.v1 import job_service_pb2 as js
from springback.v1 import types_pb2 as pb

pytestmark = pytest.mark.timeout(180)

SPEC = {"name": "history", "min_workers": 2, "max_workers": 2,
        "data": {"num_samples": 240, "global_batch_size": 12, "seed": 3}, "max_steps": 40}


def cli(address: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "springback.cli", "--coordinator", address,
                           *args], capture_output=True, text=True, timeout=60)


@pytest.fixture
def finished_job(tmp_path, client, coordinator_address):
    """A job of two agents (3 ranks) that lived through a rank crash, then succeeded."""
    job = client.create_job({**SPEC, "checkpoint": {"uri": f"file://{tmp_path}/ckpt",
                                                     "every_steps": 10}})
    agents = [AgentProcess(tmp_path, "a", job.id, coordinator_address, nproc=2, env={
        "TINY_CRASH_AT_STEP": "6", "TINY_CRASH_MARKER": str(tmp_path / "crashed")})]
    agents.append(AgentProcess(tmp_path, "b", job.id, coordinator_address))
    try:
        wait_for(lambda: client.get_job(job.id).status.state == pb.JOB_STATE_SUCCEEDED, 90,
                 "the job to succeed")
        yield job.id
    finally:
        for agent in agents:
            agent.stop()


class TestJobEvents:
    def test_a_finished_job_shows_each_generation_and_its_recovery_until_deleted(
            self, finished_job, coordinator_address, tmp_path):
        out = cli(coordinator_address, "--json", "job", "events", finished_job)
        assert out.returncode == 0, out.stderr
        history = json.loads(out.stdout)
        assert history["state"] == "succeeded" and history["step"] == 40
        assert history["created_at"] <= history["started_at"] <= history["finished_at"]
        generations = history["generations"]
        assert [g["generation"] for g in generations] == list(range(1, len(generations) + 1))
        kinds = [g["kind"] for g in generations]
        assert kinds[0] == "start" and kinds[-1] == "finish"
        assert "rank_failure" in kinds and "join" in kinds, kinds
        crash = generations[kinds.index("rank_failure")]
        # the survivor held the state: nothing was redone
        assert crash["world_size"] == 3 and crash["restore"] == "peers"
        assert 0 < crash["recovery_s"] < 30 and crash["steps_redone"] == 0
        assert crash["start_step"] >= 5 and crash["first_step_at"] > crash["time"]
        first_run = next(g for g in generations if g["action"] == "run")
        assert first_run["kind"] == "join" and first_run["world_size"] == 3
        assert len(first_run["members"]) == 2 and first_run["restore"] == "none"

        human = cli(coordinator_address, "job", "events", finished_job)
        assert human.returncode == 0, human.stderr
        assert "rank_failure" in human.stdout and "reported a failure" in human.stdout
        assert f"job      {finished_job} (history)   succeeded" in human.stdout

        # `job watch` of the finished job shows the same history
        watched = cli(coordinator_address, "job", "watch", finished_job)
        assert watched.returncode == 0, watched.stderr
        assert watched.stdout == human.stdout

        # and `job delete` forgets it, keeping its checkpoints unless asked
        stored = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
        assert stored, "the job wrote checkpoints"
        out = cli(coordinator_address, "job", "delete", finished_job)
        assert out.returncode == 0, out.stderr
        assert "checkpoints kept" in out.stdout
        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == stored
        gone = cli(coordinator_address, "job", "events", finished_job)
        assert gone.returncode == 1 and "NOT_FOUND" in gone.stderr


def test_delete_of_a_live_job_is_refused_and_changes_nothing(client, coordinator_address):
    job = client.create_job(SPEC)
    out = cli(coordinator_address, "job", "delete", "--checkpoints", job.id)
    assert out.returncode == 1 and "cancel it" in out.stderr
    assert client.get_job(job.id).status.state == pb.JOB_STATE_PENDING
    client.cancel_job(job.id)
    out = cli(coordinator_address, "--json", "job", "delete", job.id)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"id": job.id, "deleted": True, "checkpoints_deleted": []}


def test_delete_with_checkpoints_removes_their_files(tmp_path, client, coordinator_address):
    job = client.create_job({**SPEC, "min_workers": 1, "max_steps": 12,
                             "checkpoint": {"uri": f"file://{tmp_path}/ckpt", "every_steps": 5}})
    agent = AgentProcess(tmp_path, "a", job.id, coordinator_address)
    try:
        wait_for(lambda: client.get_job(job.id).status.state == pb.JOB_STATE_SUCCEEDED, 60,
                 "the job to succeed")
    finally:
        agent.stop()
    assert list((tmp_path / "ckpt").iterdir())
    out = cli(coordinator_address, "--json", "job", "delete", "--checkpoints", job.id)
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["checkpoints_deleted"]) >= 2
    assert [p for p in (tmp_path / "ckpt").iterdir() if any(p.iterdir())] == []


class TestHistoryRecords:
    def test_a_generation_records_the_start_its_ranks_report(self, etcd_endpoint):
        from springback.service.etcd.store import Store

        store = Store(etcd_endpoint)
        try:
            job = pb.Job(id="j", status=pb.JobStatus(state=pb.JOB_STATE_RUNNING, message="x"))
            plan = pb.Plan(generation=4, action=pb.PLAN_ACTION_RUN, step=30, world_size=2,
                           restore=pb.RestoreSource(kind=pb.RESTORE_KIND_CHECKPOINT))
            history = History(store, lambda: [])
            (op,) = history.on_change(job, plan, js.CHANGE_KIND_RANK_FAILURE)
            assert op.key in ("/springback/v1/history/j/000000000004",
                              b"/springback/v1/history/j/000000000004")
            planned = js.GenerationEvent.FromString(op.value)
            assert planned.kind == js.CHANGE_KIND_RANK_FAILURE and planned.reason == "x"
            assert planned.steps_redone == 0 and planned.start_step == 30  # only expected
            assert job.started_at.seconds > 0 and not job.finished_at.seconds
            assert store.transaction([], [op])  # what the coordinator's change writes
            # the ranks' start report says what happened; the first step records it
            history.on_start("j", 4, step=28, steps_redone=9,
                             restored_from=pb.RESTORE_KIND_CHECKPOINT)
            history.on_progress("j", 4)
            history.flush()
            events = history.events("j")
            assert [(e.start_step, e.steps_redone) for e in events] == [(28, 9)]
        finally:
            store.close()

    @pytest.mark.timeout(5)
    @pytest.mark.parametrize("kinds, state, recorded", [
        ({js.CHANGE_KIND_RANK_FAILURE}, pb.JOB_STATE_RUNNING, js.CHANGE_KIND_RANK_FAILURE),
        # a departure folded into a change: the worse of the two is recorded
        ({js.CHANGE_KIND_OTHER, js.CHANGE_KIND_NODE_LOST}, pb.JOB_STATE_RUNNING,
         js.CHANGE_KIND_NODE_LOST),
        ({js.CHANGE_KIND_JOIN, js.CHANGE_KIND_NODE_LOST}, pb.JOB_STATE_PENDING,
         js.CHANGE_KIND_NODE_LOST),
        ({js.CHANGE_KIND_RANK_FAILURE, js.CHANGE_KIND_NODE_LOST}, pb.JOB_STATE_RUNNING,
         js.CHANGE_KIND_RANK_FAILURE),
        ({js.CHANGE_KIND_DRAIN, js.CHANGE_KIND_LEAVE}, pb.JOB_STATE_RUNNING,
         js.CHANGE_KIND_DRAIN),
        # a preemption says why the node went; a lost node is still the worse
        ({js.CHANGE_KIND_DRAIN, js.CHANGE_KIND_PREEMPTED, js.CHANGE_KIND_LEAVE},
         pb.JOB_STATE_RUNNING, js.CHANGE_KIND_PREEMPTED),
        ({js.CHANGE_KIND_PREEMPTED, js.CHANGE_KIND_NODE_LOST}, pb.JOB_STATE_RUNNING,
         js.CHANGE_KIND_NODE_LOST),
        ({js.CHANGE_KIND_CONTROL, js.CHANGE_KIND_LEAVE}, pb.JOB_STATE_PAUSED,
         js.CHANGE_KIND_CONTROL),
        # an ended job records its end, whatever ended it
        ({js.CHANGE_KIND_RANK_FAILURE}, pb.JOB_STATE_FAILED, js.CHANGE_KIND_FINISH),
        (set(), pb.JOB_STATE_RUNNING, js.CHANGE_KIND_OTHER),
    ])
    def test_a_generation_records_the_first_of_its_changes_kinds_in_precedence(
            self, kinds, state, recorded):
        assert change_kind(kinds, state) == recorded
