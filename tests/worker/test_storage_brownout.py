"""A storage brown-out during a restore, end to end (issue 43's acceptance):
every node of a job is lost, three new nodes restore its newest commit from
S3 while the S3 endpoint throttles and drops a share of every request, and
the job ends SUCCEEDED, resumed right after that commit, every sample applied
exactly once.

The brown-out is tests/s3faults.py's rate mode on a fault proxy in front of a
moto server: 15 % of requests answered 503 SlowDown, 5 % reset before they
reach the server, 5 % reset after it answered, 10 % of GET bodies cut short.
It is on from before the new nodes start until the job ends (their restore,
their training, their checkpoints). The ranks keep the default storage retry
policy: each failed request is retried on its own, which the retry layer's
warnings in the agents' logs show ("transient error on read ... retrying":
one line per retried request, each counted in the store's
``RetryStats.retries``). Retrying the whole load instead fails it here, as
nearly every load meets a fault. Real etcd, coordinator, agents, gloo ranks.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
from applied import check_applied
from cluster import AgentProcess, steps
from s3faults import FaultyS3, agent_s3_env, moto_bucket
from sbtest import wait_for
from springback.v1 import types_pb2 as pb
from springback.worker.train.audit import check_exactly_once

NUM_SAMPLES, BATCH, MAX_STEPS, EVERY = 288, 12, 60, 10
NUM_NODES = 3
SEED = 43
"""The brown-out's draw (which request fails how); threads' timing varies the rest."""
ENDED = (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED)
REQUEST_RETRY = re.compile(r"transient error on (\w+) (\S+) \(attempt \d+\), retrying")
"""storage/retry.py's warning before it tries one request again."""
WHOLE_LOAD_RETRY = re.compile(r"transient error \w+ \S+ \(attempt \d+\), trying it again")
"""storage/dcpread.py's warning before every rank loads the whole checkpoint again."""


@pytest.fixture
def s3():
    """A moto S3 server, a bucket made directly, and the fault proxy in front of
    it that the agents use: (bucket URI, proxy, the agents' S3 environment)."""
    with moto_bucket("brownout") as (bucket, endpoint), FaultyS3(endpoint) as proxy:
        yield f"s3://{bucket}/ckpt", proxy, agent_s3_env(proxy.url)


def _spec(uri: str) -> dict:
    return {"name": "brownout", "min_workers": NUM_NODES, "max_workers": NUM_NODES,
            "max_steps": MAX_STEPS,
            "data": {"num_samples": NUM_SAMPLES, "global_batch_size": BATCH, "seed": 1},
            "checkpoint": {"uri": uri, "every_steps": EVERY}}


def _retries(agents: list[AgentProcess]) -> tuple[list[tuple[str, str]], int]:
    """(what, uri) of every request the agents' ranks tried again, and how
    many whole loads they tried again."""
    logs = "".join(a.log() for a in agents)
    return REQUEST_RETRY.findall(logs), len(WHOLE_LOAD_RETRY.findall(logs))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("weather", [
    "idle",
    # beside two busy loops, on a 2-core machine also running the suite's other
    # worker, the agents' heartbeats were starved past the liveness timeout once
    # in two runs (issue 48's territory): a soak until that is fixed
    pytest.param("loaded", marks=pytest.mark.soak)])
def test_a_restore_through_an_s3_brownout_resumes_after_the_newest_commit_exactly_once(
        tmp_path: Path, client, coordinator_address, s3, weather, request):
    if weather == "loaded":
        request.getfixturevalue("loaded")
    uri, proxy, env = s3
    started = time.monotonic()
    job_id = client.create_job(_spec(uri)).id
    agents = [AgentProcess(tmp_path, f"a{i}", job_id, coordinator_address, env=env)
              for i in range(NUM_NODES)]
    try:
        # Three nodes train on a clean store until a commit, then all are lost at once.
        wait_for(lambda: client.get_job(job_id).status.last_checkpoint.step >= 3 * EVERY, 150,
                 f"a commit at step {3 * EVERY}")
        for agent in agents:
            agent.signal_node(signal.SIGKILL)
        for agent in agents:
            agent.wait(30)
        lost = client.get_job(job_id).status
        committed, generation = lost.last_checkpoint.step, lost.generation
        restoring = lost.last_checkpoint.uri.removeprefix("s3:/")  # its objects' request paths

        proxy.injector.rate(SEED)  # the brown-out, from before the new nodes start
        second = [AgentProcess(tmp_path, f"b{i}", job_id, coordinator_address, env=env)
                  for i in range(NUM_NODES)]
        agents += second
        resumed = wait_for(lambda: [r for r in steps(tmp_path) if r["generation"] > generation],
                           150, "a step after the restore")
        during_restore = [f for f in list(proxy.injector.injected) if f[2].startswith(restoring)]

        job = wait_for(lambda: (j := client.get_job(job_id)).status.state in ENDED and j, 150,
                       "the job to end")
        faults = list(proxy.injector.injected)
        proxy.injector.clear()
        assert job.status.state == pb.JOB_STATE_SUCCEEDED, job.status.message
        for agent in second:
            agent.wait(60)
    finally:
        for agent in agents:
            agent.stop()

    resumed = [r for r in steps(tmp_path) if r["generation"] > generation]
    assert min(r["step"] for r in resumed) == committed + 1, "not resumed after the newest commit"
    report = check_exactly_once(str(tmp_path / "audit"), num_samples=NUM_SAMPLES,
                                global_batch_size=BATCH, last_step=MAX_STEPS)
    assert report.ok, report
    applied = check_applied(tmp_path / "audit", num_samples=NUM_SAMPLES, global_batch_size=BATCH,
                            seed=1, last_step=MAX_STEPS)
    assert applied.ok, applied
    # The brown-out reached the restore (requests for the restored commit failed) ...
    assert during_restore, f"no fault injected into the restore of {restoring}"
    # ... and failed requests were tried again, each on its own.
    retried, whole_loads = _retries(second)
    restore_retries = [r for r in retried if r[0] == "read" and restoring in r[1]]
    assert restore_retries, "no request of the restore was retried"
    # Not by loading the whole checkpoint again on every rank (6 whole loads in
    # the run with requests not retried alone, as before issue 43). One is
    # allowed: a GET failing all 8 of its tries at a 35 % fault rate
    # (0.35 ** 8, ~2e-4 per GET) spends its budget and is loaded again whole.
    assert whole_loads <= 1, f"{whole_loads} whole-load retries ({len(retried)} request retries)"
    print(f"{weather}: committed {committed}, {len(faults)} faults injected "
          f"({len(during_restore)} into the restore before its first step), "
          f"{len(retried)} requests retried ({len(restore_retries)} restore reads), "
          f"{whole_loads} whole-load retries, {job.status.generation} generations, "
          f"{time.monotonic() - started:.0f}s")


DRAIN_REQUEST_DELAY_S = 2.0


@pytest.mark.timeout(200)
def test_a_drain_checkpoint_on_a_slow_store_commits_and_the_survivor_trains_on_from_it(
        tmp_path: Path, client, coordinator_address, s3):
    """One of two nodes drains while every S3 request takes 2 s. The drain
    checkpoint is a collective of both nodes' ranks, waited for; rank 0's
    part (its write, then the commit: about five more requests) ends ~10 s
    after the other rank's, longer than the 5 s collective timeout. The
    other rank must wait for rank 0 in the save: before, it went on to the
    next step's collective, timed out there, the generation broke, the
    coordinator refused the drain's commit from the broken generation and
    the job kept no checkpoint of its training."""
    uri, proxy, env = s3
    spec = {"name": "slow-drain", "min_workers": 1, "max_workers": 2, "max_steps": 2000,
            "data": {"num_samples": NUM_SAMPLES, "global_batch_size": BATCH, "seed": 1},
            "checkpoint": {"uri": uri, "every_steps": 1000}}
    job_id = client.create_job(spec).id
    agents = [AgentProcess(tmp_path, f"a{i}", job_id, coordinator_address,
                           env={**env, "TINY_STEP_SLEEP_S": "0.2"}) for i in range(2)]
    survivor, drained = agents
    try:
        wait_for(lambda: len({r["step"] for r in steps(tmp_path) if r["world_size"] == 2}) >= 5,
                 120, "five steps at world 2")
        proxy.injector.slow(DRAIN_REQUEST_DELAY_S)
        drained.process.send_signal(signal.SIGTERM)
        assert drained.wait(90) == 0, drained.log()
        proxy.injector.clear()
        drained_at = max(r["step"] for r in steps(tmp_path) if r["world_size"] == 2)
        wait_for(lambda: any(r["world_size"] == 1 and r["step"] > drained_at
                             for r in steps(tmp_path)), 60, "a step of the survivor alone")
        job = client.get_job(job_id)
    finally:
        proxy.injector.clear()
        for agent in agents:
            agent.stop()
    logs = survivor.log() + drained.log()
    assert "broke" not in logs, logs[-4000:]
    assert job.status.last_checkpoint.step == drained_at, logs[-4000:]
    assert job.status.steps_redone == 0, job.status
