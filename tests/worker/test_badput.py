"""Badput by cause and cost per useful step, end to end: real etcd, a real
coordinator, real node agents, through a wait for members, checkpoints, a
node kill (every state holder lost), a join and a restore."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time

import pytest
from cluster import AgentProcess
from sbtest import scrape, wait_for
from springback.client.badput import CAUSES
from springback.client.api import Client
from springback.v1 import types_pb2 as pb

pytestmark = pytest.mark.timeout(180)

SPEC = {"name": "badput", "min_workers": 1, "max_workers": 1, "max_steps": 50,
        "data": {"num_samples": 240, "global_batch_size": 12, "seed": 1},
        "price_per_node_hour": 3.0}


def cli(address: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "springback.cli", "--coordinator", address,
                          "--json", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture
def lived(tmp_path, start_coordinator):
    """A job that waited for a member, checkpointed, lost its only node after
    step 20, waited again, and finished on a joiner restored from the commit.
    Yields the server, the job id and the test's own measure of the job's
    life: seconds from just before its creation to the poll that saw it
    SUCCEEDED, read on this process's wall clock. Not the monotonic clock:
    a fresh-clone run measured 27.2 s against the job's 41.9 s because the
    machine was paused for ~14 s (the kernel logged "crng reseeded due to
    virtual machine fork" then: a VM snapshot), which stops the monotonic
    clock but not the time that passed, which the job's records keep."""
    server = start_coordinator(metrics_listen="127.0.0.1:0")
    wait_for(server.election.is_leader, 10, "the coordinator to lead")
    agents: list[AgentProcess] = []
    with Client(server.address) as client:
        # every_steps auto, bounded to 10: the interval reaches the ranks through the plan
        created = time.time()
        job = client.create_job({**SPEC, "checkpoint": {
            "uri": f"file://{tmp_path}/ckpt", "every_steps": "auto",
            "min_every_steps": 10, "max_every_steps": 10}})
        try:
            slow = {"TINY_STEP_SLEEP_S": "0.15"}
            wait_for(lambda: client.get_job(job.id).status.state == pb.JOB_STATE_PENDING, 10,
                     "the job to wait for members")
            agents.append(AgentProcess(tmp_path, "a", job.id, server.address, env=slow))
            wait_for(lambda: client.get_job(job.id).status.last_checkpoint.step >= 20, 60,
                     "a commit at step 20")
            wait_for(lambda: client.get_job(job.id).status.step >= 24, 30, "step 24")
            agents[0].signal_node(signal.SIGKILL)
            wait_for(lambda: client.get_job(job.id).status.state == pb.JOB_STATE_PENDING, 30,
                     "the node's loss to be planned")
            agents.append(AgentProcess(tmp_path, "b", job.id, server.address, env=slow))
            wait_for(lambda: client.get_job(job.id).status.state == pb.JOB_STATE_SUCCEEDED, 90,
                     "the job to succeed")
            yield server, job.id, time.time() - created
        finally:
            for agent in agents:
                agent.stop()


def test_causes_sum_to_the_wall_time_and_each_is_where_it_happened(lived):
    server, job_id, lived_s = lived
    got = cli(server.address, "job", "get", job_id)
    events = cli(server.address, "job", "events", job_id)
    wall, causes = got["badput"]["wall_s"], got["badput"]["causes_s"]
    assert set(causes) == set(CAUSES)
    assert math.isclose(sum(causes.values()), wall, rel_tol=0.01), causes
    # the wall time is the job's: from its creation to its end, by the test's own reading
    assert wall == pytest.approx(lived_s, abs=1.0), (wall, lived_s)
    assert events["badput"]["wall_s"] == pytest.approx(wall, rel=0.01)
    # everything happened once: a wait, start-up, checkpoints, a node loss,
    # a re-formed world restored from the commit, the steps since it redone
    for cause in CAUSES:
        assert causes[cause] > 0, (cause, causes)
    assert causes["useful"] > causes["redone"] > 0

    gens = events["generations"]
    for g in gens:
        assert math.isclose(sum(g["badput_s"].values()), g["wall_s"], abs_tol=1e-6), g
    assert sum(g["wall_s"] for g in gens) == pytest.approx(wall, rel=0.01)
    waits = [g for g in gens if g["action"] == "wait"]
    assert len(waits) >= 2  # before the first member, and after the loss
    for g in waits:
        assert g["badput_s"]["waiting"] == g["wall_s"], g
    runs = [g for g in gens if g["action"] == "run"]
    assert all(g["checkpoint_interval"]["every_steps"] == 10 for g in runs)
    first, joined = runs[0], runs[-1]
    # the first world: start-up, training, checkpoints, then the loss went unseen a while
    assert first["badput_s"]["startup"] > 0 and first["badput_s"]["detection"] > 0
    assert first["badput_s"]["checkpoint"] > 0 and first["badput_s"]["useful"] > 0
    assert first["badput_s"]["reforming"] == first["badput_s"]["redone"] == 0
    assert first["badput_s"]["waiting"] == 0
    # the joiner's world: restored from the commit, redid the steps after it, no failure after
    assert joined["restore"] == "checkpoint" and joined["steps_redone"] > 0
    assert joined["badput_s"]["state_transfer"] > 0 and joined["badput_s"]["redone"] > 0
    assert joined["badput_s"]["reforming"] > 0 and joined["badput_s"]["detection"] == 0
    # distributions: rank 0's step times per generation; each step sleeps 0.15 s
    for g in runs:
        q = g["step_time_s"]
        assert 0.15 <= q["p50"] <= q["p90"] <= q["p99"], g

    # cost: node-hours of the wall time held (one node; no spares), per useful step
    cost = got["cost"]
    assert cost["node_hours_spares"] == 0
    assert cost["node_hours_useful"] == pytest.approx(causes["useful"] / 3600, rel=0.01)
    assert 0 < cost["node_hours_useful"] < cost["node_hours"] <= wall / 3600 * 1.01
    assert cost["cost"] == pytest.approx(cost["node_hours"] * 3.0)
    assert cost["cost_per_useful_step"] == pytest.approx(cost["cost"] / SPEC["max_steps"])
    assert cost["cost_per_1000_samples"] == pytest.approx(
        cost["cost"] / (SPEC["max_steps"] * 12) * 1000)

    samples = scrape(server.metrics_address)
    by_cause = {c: samples[f'springback_job_badput_seconds_total{{cause="{c}",job="{job_id}"}}']
                for c in CAUSES}
    assert sum(by_cause.values()) == pytest.approx(wall, rel=0.01)
    assert all(v > 0 for v in by_cause.values()), by_cause
    assert samples[f'springback_job_cost_per_useful_step{{job="{job_id}"}}'] == pytest.approx(
        cost["cost_per_useful_step"], rel=0.01)
    last = runs[-1]["step_time_s"]  # the newest generation's percentiles, as job events has them
    for q, key in (("0.5", "p50"), ("0.9", "p90"), ("0.99", "p99")):
        assert samples[f'springback_job_step_seconds{{job="{job_id}",quantile="{q}"}}'] == \
            pytest.approx(last[key])
