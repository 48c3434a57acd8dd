"""Rank logs: prefixed by rank, shipped beside the checkpoints (in the job's
own directory) by real node agents, read back through `springback job logs`
against a real coordinator."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from cluster import AgentProcess, steps
from sbtest import wait_for
from springback.v1 import types_pb2 as pb

pytestmark = pytest.mark.timeout(180)

SPEC = {"name": "logs", "min_workers": 2, "max_workers": 2,
        "data": {"num_samples": 240, "global_batch_size": 12, "seed": 4}, "max_steps": 20}
LINE = re.compile(r"^\[rank(\d)\] trained step (\d+) in generation \d+$")
ANY_LABEL = re.compile(r"^\[(?:local-)?rank(\d)\] trained step (\d+) in generation \d+$")
"""A one-rank node's lines: once the job ended its last plan no longer places
the member, so the agent labels the last lines by local rank (`rank_label`)."""


def cli(address: str, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "springback.cli", "--coordinator",
                             address, "job", "logs", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def test_job_logs_show_every_rank_s_lines_with_its_rank(tmp_path, client, coordinator_address):
    job = client.create_job({**SPEC, "checkpoint": {"uri": f"file://{tmp_path}/ckpt",
                                                     "every_steps": 20}})
    env = {"TINY_PRINT_STEPS": "1", "TINY_STEP_SLEEP_S": "0.1"}
    agents = [AgentProcess(tmp_path, "a", job.id, coordinator_address, "--no-standby", nproc=2,
                           env=env),
              AgentProcess(tmp_path, "b", job.id, coordinator_address, "--no-standby", env=env)]
    try:
        wait_for(lambda: any(r["step"] >= 3 for r in steps(tmp_path)), 60, "training")
        follow = cli(coordinator_address, "--follow", job.id)  # started mid-run
        wait_for(lambda: client.get_job(job.id).status.state == pb.JOB_STATE_SUCCEEDED, 90,
                 "the job to succeed")
        assert [a.wait(30) for a in agents] == [0, 0]
        followed, err = follow.communicate(timeout=60)
        assert follow.returncode == 0, err
    finally:
        for agent in agents:
            agent.stop()

    # every rank's every step, with its global rank, exactly once
    lines = [m.groups() for m in map(LINE.match, followed.splitlines()) if m]
    assert len(lines) == len(followed.splitlines()), followed  # nothing but prefixed lines
    assert sorted(set(lines)) == sorted((str(r), str(s)) for r in range(3) for s in range(1, 21))
    assert len(lines) == 3 * 20
    echoed = [LINE.match(line) for line in agents[0].log().splitlines()]  # the agent's output
    assert len({m[1] for m in echoed if m}) == 2  # a's two ranks, prefixed there too

    members = sorted(p.name for p in (tmp_path / "ckpt" / job.id / "logs").iterdir())
    assert not (tmp_path / "ckpt" / "logs").exists()  # in the job's directory, nowhere else
    assert len(members) == 2
    out = subprocess.run([sys.executable, "-m", "springback.cli", "--coordinator",
                          coordinator_address, "job", "logs", "--member", members[0], job.id],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    ranks = {m[1] for m in map(LINE.match, out.stdout.splitlines()) if m}
    assert len(ranks) in (1, 2) and len(out.stdout.splitlines()) == 20 * len(ranks)  # one node's

    wrong = subprocess.run([sys.executable, "-m", "springback.cli", "--coordinator",
                            coordinator_address, "job", "logs", "--member", "m-nope", job.id],
                           capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 1 and "m-nope" in wrong.stderr and members[0] in wrong.stderr


def job_cli(address: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "springback.cli", "--coordinator", address,
                           "job", *args], capture_output=True, text=True, timeout=60)


def test_jobs_sharing_a_checkpoint_uri_see_and_delete_only_their_own_logs(
        tmp_path, client, coordinator_address):
    uri = f"file://{tmp_path}/shared"  # one job.yaml submitted twice, say
    max_steps = {"a": 4, "b": 7}  # told apart by how many steps they print
    jobs = {name: client.create_job({**SPEC, "name": f"logs-{name}", "min_workers": 1,
                                     "max_workers": 1, "max_steps": n,
                                     "checkpoint": {"uri": uri, "every_steps": 2}})
            for name, n in max_steps.items()}
    env = {"TINY_PRINT_STEPS": "1", "TINY_STEP_SLEEP_S": "0.05"}
    agents = []
    for name, job in jobs.items():
        (tmp_path / name).mkdir()
        agents.append(AgentProcess(tmp_path / name, name, job.id, coordinator_address,
                                   "--no-standby", env=env))
    try:
        for job in jobs.values():
            wait_for(lambda job=job: client.get_job(job.id).status.state
                     == pb.JOB_STATE_SUCCEEDED, 90, f"job {job.id} to succeed")
        assert [a.wait(30) for a in agents] == [0, 0]  # their last lines are shipped
    finally:
        for agent in agents:
            agent.stop()

    def assert_own_steps(name: str, out: subprocess.CompletedProcess) -> None:
        # its own steps, exactly once: none of the other job's (a rank may log
        # more, e.g. a periodic checkpoint skipped while the last is written)
        assert out.returncode == 0, out.stderr
        lines = [m.groups() for m in map(ANY_LABEL.match, out.stdout.splitlines()) if m]
        assert sorted(lines) == sorted(("0", str(s)) for s in range(1, max_steps[name] + 1)), (
            name, out.stdout)

    members = {}
    for name, job in jobs.items():
        assert_own_steps(name, job_cli(coordinator_address, "logs", job.id))
        members[name] = sorted(p.name for p in (tmp_path / "shared" / job.id / "logs").iterdir())
        assert len(members[name]) == 1
    wrong = job_cli(coordinator_address, "logs", "--member", members["b"][0], jobs["a"].id)
    assert wrong.returncode == 1 and members["b"][0] in wrong.stderr  # b's member is not a's

    deleted = job_cli(coordinator_address, "delete", "--checkpoints", jobs["a"].id)
    assert deleted.returncode == 0, deleted.stderr
    assert not (tmp_path / "shared" / jobs["a"].id / "logs").exists()
    assert_own_steps("b", job_cli(coordinator_address, "logs", jobs["b"].id))  # untouched


def test_an_agent_ships_into_the_job_s_own_directory():
    from springback.worker.agent.ranklogs import job_logs_base

    plan = pb.Plan(job_id="j-1", spec=pb.JobSpec(checkpoint=pb.CheckpointSpec(uri="s3://b/c/")))
    assert job_logs_base(plan, "j-env") == "s3://b/c/j-1"
    plan.job_id = ""
    assert job_logs_base(plan, "j-env") == "s3://b/c/j-env"
    assert job_logs_base(pb.Plan(job_id="j-1"), "j-1") is None  # no checkpoint.uri: echo only
    assert job_logs_base(None, "j-1") is None  # no plan yet


class TestShipping:
    @staticmethod
    def rank_logs(tmp_path, base: str, flush_interval_s: float = 60, **kw):  # noqa: ANN205
        import io

        from springback.worker.agent.ranklogs import RankLogs

        return RankLogs(label_of=lambda proc: "rank0", member_of=lambda: "m-1",
                        base_uri_of=lambda: base, echo=io.BytesIO(),
                        flush_interval_s=flush_interval_s, **kw)

    @staticmethod
    def run_rank(logs, *lines: str) -> None:
        proc = subprocess.Popen([sys.executable, "-c", "\n".join(f"print({x!r})" for x in lines)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        logs.attach(proc)
        proc.wait(timeout=30)

    @staticmethod
    def shipped(base: str) -> str:
        from springback.storage.ranklogs import list_chunks
        from springback.storage.store import ObjectStore

        store = ObjectStore(base)
        return "".join(store.get_bytes(c.uri).decode() for c in list_chunks(store, base))

    def test_shipping_imports_no_torch(self, tmp_path):
        """A node agent ships its ranks' lines through the object store alone:
        `springback.storage` imports its checkpoint modules (and torch, over
        2 CPU s each time) only when one of their names is used."""
        base = f"file://{tmp_path}/ckpt/j-1"
        script = f"""
import io, subprocess, sys
from springback.worker.agent.ranklogs import RankLogs
logs = RankLogs(label_of=lambda proc: "rank0", member_of=lambda: "m-1",
                base_uri_of=lambda: {base!r}, echo=io.BytesIO(), flush_interval_s=60)
proc = subprocess.Popen([sys.executable, "-c", "print('a line')"], stdout=subprocess.PIPE)
logs.attach(proc)
proc.wait(timeout=30)
logs.close()
print("torch imported:", "torch" in sys.modules)
"""
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "torch imported: False", out
        assert self.shipped(base) == "[rank0] a line\n"

    def test_a_failed_upload_keeps_the_lines_for_the_next_flush(self, tmp_path):
        blocked = tmp_path / "ckpt"
        blocked.write_text("a file where the log directory should be")
        logs = self.rank_logs(tmp_path, f"file://{blocked}")
        self.run_rank(logs, "first", "second")
        logs.close()  # the readers are done; its last ship fails
        assert logs.ship() is False
        blocked.unlink()
        assert logs.ship() is True
        assert self.shipped(f"file://{blocked}") == "[rank0] first\n[rank0] second\n"

    @pytest.mark.timeout(60)
    def test_close_waits_for_a_shipment_in_flight(self, tmp_path, monkeypatch):
        """A shipment holds the lines it took until they are written; close()
        must not give up on it after its own 5 s (the agent exits next): in a
        2-worker suite run a first shipment (it imported torch then) took
        longer, and every line of a short job was lost. Here the upload's
        first request takes 6 s."""
        from s3faults import FaultyS3, agent_s3_env, moto_bucket

        with moto_bucket("ranklogs") as (bucket, endpoint), FaultyS3(endpoint) as proxy:
            for name, value in agent_s3_env(proxy.url).items():
                monkeypatch.setenv(name, value)
            base = f"s3://{bucket}/ckpt/job"
            logs = self.rank_logs(tmp_path, base, flush_interval_s=0.05)
            proxy.injector.slow(6.0, count=1)
            logs.start()
            self.run_rank(logs, "the only line")
            wait_for(lambda: proxy.injector.injected, 20, "a shipment in flight")
            logs.close()
            assert self.shipped(base) == "[rank0] the only line\n"

    def test_past_the_buffer_cap_the_oldest_lines_are_dropped_and_counted(self, tmp_path):
        logs = self.rank_logs(tmp_path, f"file://{tmp_path}/ckpt", max_buffer_bytes=40)
        self.run_rank(logs, "line-1", "line-2", "line-3", "line-4")  # 16 bytes each, prefixed
        logs.close()
        assert self.shipped(f"file://{tmp_path}/ckpt") == (
            "[agent] 2 line(s) dropped: the buffer filled before they could be shipped\n"
            "[rank0] line-3\n[rank0] line-4\n")
