"""Job control through the Python client and the CLI, against real etcd + gRPC."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import grpc
import pytest

from sbtest import wait_for
from springback.client.api import ApiError
from springback.v1 import job_service_pb2 as js
from springback.v1 import job_service_pb2_grpc as js_grpc
from springback.v1 import types_pb2 as pb

pytestmark = pytest.mark.timeout(60)


class TestJobLifecycle:
    def test_a_created_job_is_pending_until_members_join(self, client, make_spec):
        job = client.create_job(make_spec(name="lm"))
        assert job.id.startswith("lm-")
        got = client.get_job(job.id)
        assert got.status.state == pb.JOB_STATE_PENDING
        assert got.status.generation == 1
        assert got.spec.min_workers == 1 and got.spec.layout.tp == 1
        assert [j.id for j in client.list_jobs()] == [job.id]

    def test_pause_resume_cancel_follow_the_state_machine(self, client, make_spec):
        job = client.create_job(make_spec())
        assert client.pause_job(job.id).status.state == pb.JOB_STATE_PAUSED
        assert client.pause_job(job.id).status.state == pb.JOB_STATE_PAUSED  # idempotent
        assert client.resume_job(job.id).status.state == pb.JOB_STATE_PENDING
        assert client.cancel_job(job.id).status.state == pb.JOB_STATE_CANCELLED
        with pytest.raises(ApiError) as e:
            client.resume_job(job.id)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "CANCELLED" in e.value.details
        assert client.get_job(job.id).status.state == pb.JOB_STATE_CANCELLED

    def test_scale_changes_min_and_max(self, client, make_spec):
        job = client.create_job(make_spec())
        scaled = client.scale_job(job.id, 2, 4)
        assert (scaled.spec.min_workers, scaled.spec.max_workers) == (2, 4)
        assert client.get_job(job.id).spec.max_workers == 4

    def test_watch_streams_each_change(self, client, make_spec):
        job = client.create_job(make_spec())
        events: list[str] = []
        seen_pause = threading.Event()

        def watch() -> None:
            for got, event in client.watch_job(job.id, timeout_s=30):
                events.append(event)
                if got.status.state == pb.JOB_STATE_PAUSED:
                    seen_pause.set()
                if got.status.state == pb.JOB_STATE_CANCELLED:
                    return

        thread = threading.Thread(target=watch)
        thread.start()
        wait_for(lambda: events, 10, "the watch stream's first event")
        client.pause_job(job.id)
        assert seen_pause.wait(10)
        client.cancel_job(job.id)
        thread.join(10)
        assert not thread.is_alive()
        assert "paused" in events and events[-1] == "cancelled"


class TestBadInput:
    def test_unknown_job_is_not_found(self, client):
        for call in (client.get_job, client.pause_job, client.cancel_job, client.list_checkpoints):
            with pytest.raises(ApiError) as e:
                call("no-such-job")
            assert e.value.code == grpc.StatusCode.NOT_FOUND

    @pytest.mark.parametrize(
        ("mutate", "field"),
        [
            (lambda s: setattr(s, "name", "Bad Name"), "name"),
            (lambda s: setattr(s, "max_steps", 0), "max_steps"),
            (lambda s: setattr(s.data, "num_samples", 0), "data.num_samples"),
            (lambda s: setattr(s.data, "global_batch_size", 0), "data.global_batch_size"),
            (lambda s: setattr(s.data, "global_batch_size", 5000), "data.global_batch_size"),
            (lambda s: (setattr(s, "min_workers", 4), setattr(s, "max_workers", 2)), "max_workers"),
            (lambda s: setattr(s.checkpoint, "uri", "ftp://x"), "checkpoint.uri"),
            (lambda s: setattr(s.checkpoint, "every_steps", 10), "checkpoint.uri"),
            (lambda s: setattr(s, "price_per_node_hour", -1.5), "price_per_node_hour"),
            (lambda s: setattr(s, "price_per_node_hour", float("nan")), "price_per_node_hour"),
            (lambda s: setattr(s.checkpoint, "auto_interval", True), "checkpoint.uri"),
            (lambda s: (setattr(s.checkpoint, "uri", "/tmp/c"),
                        setattr(s.checkpoint, "auto_interval", True),
                        setattr(s.checkpoint, "min_every_steps", 9),
                        setattr(s.checkpoint, "max_every_steps", 3)), "checkpoint.min_every_steps"),
        ],
    )
    def test_a_bad_spec_is_rejected_naming_the_field_and_nothing_is_stored(
        self, coordinator, client, mutate, field
    ):
        spec = pb.JobSpec(name="ok", max_steps=10, data=pb.DataSpec(num_samples=100, global_batch_size=10))
        mutate(spec)
        stub = js_grpc.JobServiceStub(grpc.insecure_channel(coordinator.address))
        with pytest.raises(grpc.RpcError) as e:
            stub.CreateJob(js.CreateJobRequest(spec=spec), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith(f"{field}:")
        assert client.list_jobs() == []

    def test_bad_scale_is_rejected_and_changes_nothing(self, client, make_spec):
        job = client.create_job(make_spec())
        with pytest.raises(ApiError) as e:
            client.scale_job(job.id, 3, 1)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "max_workers" in e.value.details
        assert client.get_job(job.id).spec.max_workers == 3

    def test_restore_without_a_commit_is_not_found(self, client, make_spec):
        job = client.create_job(make_spec())
        with pytest.raises(ApiError) as e:
            client.restore_job(job.id, 10)
        assert e.value.code == grpc.StatusCode.NOT_FOUND


def _cli(address: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "springback.cli", "--coordinator", address, *args],
        capture_output=True, text=True, timeout=30, env={**os.environ},
    )


class TestCommandLine:
    def test_job_lifecycle_through_the_cli(self, coordinator_address, tmp_path):
        spec = tmp_path / "job.yaml"
        spec.write_text(
            "name: cli\nmin_workers: 1\nmax_workers: 2\nlayout: {tp: 1}\n"
            "data: {num_samples: 100, global_batch_size: 10, seed: 3}\n"
            "checkpoint: {uri: 'file:///tmp/ckpt', every_steps: 5, keep_last: 2}\nmax_steps: 20\n"
        )
        submitted = _cli(coordinator_address, "--json", "job", "submit", str(spec))
        assert submitted.returncode == 0, submitted.stderr
        job = json.loads(submitted.stdout)
        for key in ("id", "name", "state", "generation", "world_size", "members", "step",
                    "samples_consumed", "last_checkpoint"):
            assert key in job
        assert job["state"] == "pending" and job["spec"]["checkpoint"]["keep_last"] == 2
        job_id = job["id"]
        # Global flags work after the subcommand too.
        assert json.loads(_cli(coordinator_address, "job", "get", job_id, "--json").stdout)["id"] == job_id
        listed = json.loads(_cli(coordinator_address, "--json", "job", "list").stdout)
        assert [j["id"] for j in listed] == [job_id]
        scaled = _cli(coordinator_address, "--json", "job", "scale", job_id, "--min", "1", "--max", "3")
        assert json.loads(scaled.stdout)["spec"]["max_workers"] == 3
        for action, state in (("pause", "paused"), ("resume", "pending"), ("cancel", "cancelled")):
            out = _cli(coordinator_address, "--json", "job", action, job_id)
            assert out.returncode == 0, out.stderr
            assert json.loads(out.stdout)["state"] == state
        human = _cli(coordinator_address, "job", "get", job_id)
        assert "cancelled" in human.stdout and job_id in human.stdout
        refused = _cli(coordinator_address, "job", "resume", job_id)
        assert refused.returncode == 1 and "FAILED_PRECONDITION" in refused.stderr

    def test_a_bad_spec_file_names_the_file_and_field(self, coordinator_address, tmp_path):
        spec = tmp_path / "bad.json"
        spec.write_text(json.dumps({"name": "x", "data": {"num_samples": 10, "global_batch_size": "8"},
                                    "max_steps": 1}))
        out = _cli(coordinator_address, "job", "submit", str(spec))
        assert out.returncode == 2
        assert "data.global_batch_size" in out.stderr and "bad.json" in out.stderr
        unknown = tmp_path / "typo.yaml"
        unknown.write_text("name: x\nmax_step: 3\ndata: {num_samples: 1, global_batch_size: 1}\n")
        out = _cli(coordinator_address, "job", "submit", str(unknown))
        assert out.returncode == 2 and "max_step" in out.stderr
        assert json.loads(_cli(coordinator_address, "--json", "job", "list").stdout) == []

    def test_watch_prints_until_the_job_ends(self, coordinator_address, client, make_spec):
        job = client.create_job(make_spec())
        watcher = subprocess.Popen(
            [sys.executable, "-m", "springback.cli", "--coordinator", coordinator_address,
             "--json", "job", "watch", job.id], stdout=subprocess.PIPE, text=True,
        )
        first = json.loads(watcher.stdout.readline())
        assert first["id"] == job.id
        client.cancel_job(job.id)
        rest = [json.loads(line) for line in watcher.stdout]
        assert watcher.wait(timeout=20) == 0
        assert rest[-1]["state"] == "cancelled"
