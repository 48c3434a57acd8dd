"""The end of a job must be confirmed by the coordinator, not assumed by the
ranks: a final step report lost to an outage is sent again until the job
succeeds (real etcd, `springback coordinator` subprocesses, real agents)."""

from __future__ import annotations

import pytest

from cluster import AgentProcess, steps
from sbtest import wait_for
from springback.client.api import Client
from springback.cli.local import free_port
from springback.v1 import types_pb2 as pb

SPEC = {"name": "tiny", "min_workers": 2, "max_workers": 2,
        "data": {"num_samples": 256, "global_batch_size": 12, "seed": 1}, "max_steps": 40}


@pytest.mark.timeout(180)
def test_a_final_report_lost_to_a_coordinator_outage_is_sent_again_until_the_job_succeeds(
        spawn_coordinator, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    # liveness well above the outage: members must outlive it, only the report is lost
    options = ("--listen", address, "--liveness-timeout-s", "15")
    coordinator = spawn_coordinator(*options)
    with Client(address) as client:
        job = wait_for(lambda: client.create_job(SPEC), 20, "a leader to take the job")
        agents = [AgentProcess(tmp_path, n, job.id, address) for n in ("a", "b")]
        try:
            wait_for(lambda: any(r["step"] >= 30 for r in steps(tmp_path)), 90, "step 30")
            coordinator.kill()
            # rank 0 logs a step before it reports it: the last report is lost
            wait_for(lambda: any(r["step"] == 40 for r in steps(tmp_path)), 60, "step 40")
            assert all(a.process.poll() is None for a in agents), "agents ended unconfirmed"
            spawn_coordinator(*options)
            done = wait_for(
                lambda: (j := client.get_job(job.id)).status.state == pb.JOB_STATE_SUCCEEDED
                and j, 60, "the job to succeed after the outage")
            assert done.status.step == 40
            for agent in agents:
                assert agent.wait(60) == 0, agent.log()
        finally:
            for agent in agents:
                agent.stop()
