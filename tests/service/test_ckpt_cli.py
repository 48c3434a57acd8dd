"""`springback ckpt list|verify|restore` against a coordinator and real files."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
import torch

from springback.service.etcd import keys
from springback.storage import Checkpointer, job_checkpoint_uri
from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as ws
from springback.v1 import worker_service_pb2_grpc as ws_grpc

pytestmark = pytest.mark.timeout(90)


def _cli(address: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "springback.cli", "--coordinator", address,
                           *args], capture_output=True, text=True, timeout=60)


def test_ckpt_commands_show_commits_partials_and_restore(coordinator, client, make_spec, tmp_path):
    base = f"file://{tmp_path}/ckpt"
    job = client.create_job(make_spec(max_workers=1, checkpoint={"uri": base, "keep_last": 5}))
    workers = ws_grpc.WorkerServiceStub(grpc.insecure_channel(coordinator.address))
    member = workers.JoinJob(ws.JoinJobRequest(job_id=job.id, host="127.0.0.1", rendezvous_port=1,
                                               num_local_ranks=1), timeout=10).member
    generation = client.get_job(job.id).status.generation

    def commit(info) -> None:  # noqa: ANN001 (storage's CommitInfo)
        workers.CommitCheckpoint(ws.CommitCheckpointRequest(
            job_id=job.id, member_id=member.id, generation=generation,
            checkpoint=info.to_checkpoint_ref()), timeout=10)

    state = {"w": torch.arange(1000, dtype=torch.float32)}
    job_dir = job_checkpoint_uri(base, job.id)  # where the job's ranks write
    checkpointer = Checkpointer(job_dir, rank=0, world_size=1, on_commit=commit)
    for step in (10, 20):
        checkpointer.save(step, state, generation=generation, cursor=(0, step * 32))
        checkpointer.wait(timeout_s=60)
    checkpointer.close()
    partial = tmp_path / "ckpt" / job.id / f"step-00000030-g{generation}"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half a shard")

    listed = _cli(coordinator.address, "--json", "ckpt", "list", job.id)
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [(r["step"], r["state"]) for r in rows] == [(30, "partial"), (20, "committed"), (10, "committed")]
    assert rows[1]["world_size"] == 1 and rows[1]["size_bytes"] > 4000
    human = _cli(coordinator.address, "ckpt", "list", job.id)
    assert "committed" in human.stdout and "partial" in human.stdout

    assert _cli(coordinator.address, "ckpt", "verify", rows[1]["uri"]).returncode == 0
    assert _cli(coordinator.address, "ckpt", "verify", base).returncode == 0  # the spec's URI: every job
    shard = next((tmp_path / "ckpt" / job.id).glob("step-00000020-*/__0_0.distcp"))
    shard.write_bytes(shard.read_bytes()[:-8] + b"corrupt!")
    bad = _cli(coordinator.address, "ckpt", "verify", rows[1]["uri"])
    assert bad.returncode == 1 and "__0_0.distcp" in bad.stdout

    workers.LeaveJob(ws.LeaveJobRequest(job_id=job.id, member_id=member.id), timeout=10)
    restored = _cli(coordinator.address, "--json", "ckpt", "restore", job.id, "--step", "10")
    assert restored.returncode == 0, restored.stderr
    # No member is left: the restore waits for the next generation that runs.
    assert json.loads(restored.stdout)["id"] == job.id
    workers.JoinJob(ws.JoinJobRequest(job_id=job.id, host="127.0.0.1", rendezvous_port=2,
                                      num_local_ranks=1), timeout=10)
    plan = coordinator.coordinator.current_plan(job.id)
    assert plan.action == pb.PLAN_ACTION_RUN
    assert plan.restore.checkpoint.step == 10 and plan.step == 10


def test_job_delete_refuses_to_remove_a_recorded_uri_outside_the_jobs_directory(
        coordinator, client, make_spec, tmp_path):
    """A job without checkpoint.uri has no directory of its own: a member's
    commit there is refused, and a record written straight into etcd
    (bypassing the coordinator) is not deleted recursively with the
    operator's rights."""
    victim = tmp_path / "not-the-jobs"
    victim.mkdir()
    (victim / "precious").write_text("kept")
    job = client.create_job(make_spec(max_workers=1))
    workers = ws_grpc.WorkerServiceStub(grpc.insecure_channel(coordinator.address))
    member = workers.JoinJob(ws.JoinJobRequest(job_id=job.id, host="127.0.0.1", rendezvous_port=1,
                                               num_local_ranks=1), timeout=10).member
    forged = pb.CheckpointRef(step=10, uri=f"file://{victim}", world_size=1)
    with pytest.raises(grpc.RpcError) as refused:
        workers.CommitCheckpoint(ws.CommitCheckpointRequest(
            job_id=job.id, member_id=member.id,
            generation=client.get_job(job.id).status.generation, checkpoint=forged), timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert client.list_checkpoints(job.id) == []
    coordinator.coordinator.store.put(keys.checkpoint(job.id, 10), forged)
    client.cancel_job(job.id)
    out = _cli(coordinator.address, "job", "delete", job.id, "--checkpoints")
    assert out.returncode == 1 and "not a checkpoint directory directly under" in out.stderr, out
    assert "nothing was deleted" in out.stderr
    assert (victim / "precious").read_text() == "kept"
    assert client.get_job(job.id).id == job.id  # the record stays too
