"""Per-member step timing (worker/train/ranktiming.py, issue 46's precursor of
a straggler) end to end: real etcd, a real coordinator, two real agents whose
gloo ranks train tiny_train.py; one agent's ranks are slowed before their
step's collective (TINY_COMPUTE_SLEEP_S), and the job's status names it."""

from __future__ import annotations

import json
import re
import signal
import urllib.request

import pytest
from cluster import AgentProcess
from sbtest import scrape, wait_for
from springback.cli.main import _human_job
from springback.client.api import Client
from springback.client.summary import job_summary
from springback.v1 import types_pb2 as pb

SPEC = {"name": "timing", "min_workers": 2, "max_workers": 2,
        "data": {"num_samples": 4096, "global_batch_size": 12, "seed": 1}, "max_steps": 100_000}
SLOW_S = 0.15  # the slowed member's extra compute per step
MIN_STEPS = 20  # steps the medians must cover


def _member_id(agent: AgentProcess) -> str | None:
    found = re.search(r"joined job \S+ as member (\S+) ", agent.log())
    return found[1] if found else None


@pytest.fixture
def served(start_coordinator):
    """A leader with its metrics and dashboard listener, and a client of it."""
    server = start_coordinator(metrics_listen="127.0.0.1:0")
    wait_for(server.election.is_leader, 10, "leadership")
    with Client(server.address) as client:
        yield server, client


class TestMemberTiming:
    @pytest.mark.timeout(120)
    def test_the_slowed_member_computes_longer_and_the_other_waits_for_it_in_the_collective(
            self, tmp_path, served):
        coordinator, client = served
        coordinator_address = coordinator.address
        job_id = client.create_job(SPEC).id
        quiet = {"TINY_STEP_SLEEP_S": "0"}  # no pause after the step: compute alone differs
        slow = AgentProcess(tmp_path, "slow", job_id, coordinator_address,
                            env={**quiet, "TINY_COMPUTE_SLEEP_S": str(SLOW_S)})
        fast = AgentProcess(tmp_path, "fast", job_id, coordinator_address, env=quiet)
        try:
            slow_id = wait_for(lambda: _member_id(slow), 30, "the slow agent's member id")
            fast_id = wait_for(lambda: _member_id(fast), 30, "the fast agent's member id")

            def timed() -> pb.Job | None:
                job = client.get_job(job_id)
                t = {m.member_id: m for m in job.status.member_timing}
                ok = {slow_id, fast_id} <= set(t) and all(
                    m.num_steps >= MIN_STEPS for m in t.values())
                return job if ok else None

            job = wait_for(timed, 90, f"both members timed over {MIN_STEPS} steps")
            t = {m.member_id: m for m in job.status.member_timing}
            s, f = t[slow_id], t[fast_id]
            # the slowed member computes its sleep longer; the other spends
            # about that sleep waiting for it in the gradient all-reduce
            assert s.compute_p50_s > f.compute_p50_s + 0.8 * SLOW_S, (s, f)
            assert f.collective_p50_s > s.collective_p50_s + 0.8 * SLOW_S, (s, f)
            assert s.compute_p50_s < 5 * SLOW_S and f.collective_p50_s < 5 * SLOW_S, (s, f)
            # `job get` shows it, as text and as JSON
            text = _human_job(job)
            assert f"timing     {slow_id}: compute p50 {s.compute_p50_s * 1e3:.1f} ms" in text
            rows = {r["member"]: r for r in job_summary(job)["member_timing"]}
            assert rows[fast_id]["collective_p50_s"] == f.collective_p50_s
            # the coordinator's metrics and the dashboard's members table, read
            # later (newer reports): the same contrast
            m = scrape(coordinator.metrics_address)

            def gauge(member: str, part: str) -> float:
                return m[f'springback_job_member_step_seconds{{job="{job_id}",member="{member}",'
                         f'part="{part}"}}']
            assert gauge(slow_id, "compute") > gauge(fast_id, "compute") + 0.8 * SLOW_S, m
            assert gauge(fast_id, "collective") > gauge(slow_id, "collective") + 0.8 * SLOW_S
            url = f"http://{coordinator.metrics_address}/jobs/{job_id}/members.json"
            with urllib.request.urlopen(url, timeout=10) as r:
                table = {row["id"]: row for row in json.load(r)["members"]}
            assert (table[slow_id]["compute_p50_s"]
                    > table[fast_id]["compute_p50_s"] + 0.8 * SLOW_S), table
        finally:
            client.cancel_job(job_id)
            for agent in (slow, fast):  # the whole node: no rank outlives the test
                agent.signal_node(signal.SIGKILL)
                agent.wait(30)
