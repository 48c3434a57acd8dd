"""The coordinator's Prometheus endpoint and structured logs."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from sbtest import OPERATOR_TOKEN, scrape, wait_for

pytestmark = pytest.mark.timeout(60)


def test_metrics_show_leadership_jobs_and_generations(start_coordinator, make_spec):
    from springback.client.api import Client

    server = start_coordinator(metrics_listen="127.0.0.1:0")
    wait_for(server.election.is_leader, 10, "leadership")
    host, port = server._metrics_server.server_address
    with Client(server.address) as client:
        job = client.create_job(make_spec())
    samples = scrape(f"{host}:{port}")
    assert samples["springback_coordinator_is_leader"] == 1.0
    assert samples[f'springback_job_generation{{job="{job.id}"}}'] == 1.0
    assert samples["springback_coordinator_generations_total"] >= 1
    assert samples['springback_coordinator_rpc_total{method="/springback.v1.JobService/CreateJob"}'] == 1


def _report_step(workers, job_id: str, member: str, generation: int, step: int, loss: float) -> None:
    from springback.v1 import worker_service_pb2 as ws

    workers.ReportStep(ws.ReportStepRequest(
        job_id=job_id, member_id=member, generation=generation, step=step,
        samples_consumed=4 * step, loss=loss), timeout=5)


def test_job_metrics_count_failures_recoveries_and_goodput(start_coordinator, make_spec):
    """Through prometheus-client's own parser: the families, their types, and
    values after a rank failure and its recovery, driven over the worker API."""
    import grpc
    from prometheus_client.parser import text_string_to_metric_families

    from springback.client.api import Client
    from springback.v1 import types_pb2 as pb
    from springback.v1 import worker_service_pb2 as ws
    from springback.v1 import worker_service_pb2_grpc as ws_grpc

    server = start_coordinator(metrics_listen="127.0.0.1:0")
    wait_for(server.election.is_leader, 10, "leadership")
    channel = grpc.insecure_channel(server.address)
    workers = ws_grpc.WorkerServiceStub(channel)
    try:
        with Client(server.address) as client:
            job = client.create_job(make_spec(min_workers=1, max_workers=1, max_steps=100))
            member = workers.JoinJob(ws.JoinJobRequest(
                job_id=job.id, host="127.0.0.1", rendezvous_port=5001, num_local_ranks=1),
                timeout=10).member.id
            first = client.get_job(job.id).status.generation
            for step in (1, 2, 3):
                _report_step(workers, job.id, member, first, step, loss=2.0 - step / 10)
            workers.ReportFailure(ws.ReportFailureRequest(
                job_id=job.id, member_id=member, generation=first, reason="rank 0 exited"), timeout=5)
            second = client.get_job(job.id).status.generation
            assert second == first + 1
            # the restarted rank had nothing to restore: it says so, then trains
            workers.ReportStep(ws.ReportStepRequest(
                job_id=job.id, member_id=member, generation=second, step=0,
                generation_start=True, restored_from=pb.RESTORE_KIND_NONE), timeout=5)
            _report_step(workers, job.id, member, second, 1, loss=1.5)
            address = server.metrics_address

            def recovered() -> dict | None:
                with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
                    families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
                histogram = families["springback_job_recovery_seconds"]
                count = [s for s in histogram.samples if s.name.endswith("_count")]
                return families if count and count[0].value == 1 else None

            families = wait_for(recovered, 10, "the recovery in the histogram")
    finally:
        channel.close()

    def value(family: str, sample: str | None = None, **labels: str) -> float:
        (match,) = [s.value for s in families[family].samples
                    if s.name == (sample or family) and s.labels == {"job": job.id, **labels}]
        return match

    assert families["springback_job_recovery_seconds"].type == "histogram"
    assert families["springback_job_failures"].type == "counter"
    assert value("springback_job_failures", "springback_job_failures_total", kind="rank_failure") == 1
    assert value("springback_job_failures", "springback_job_failures_total", kind="node_lost") == 0
    assert value("springback_job_generations", "springback_job_generations_total") == second
    assert value("springback_job_steps_redone", "springback_job_steps_redone_total") == 3
    assert value("springback_job_restores", "springback_job_restores_total") == 0
    assert value("springback_job_loss") == 1.5 and value("springback_job_step") == 1
    assert value("springback_job_running") == 1
    recovery_sum = value("springback_job_recovery_seconds", "springback_job_recovery_seconds_sum")
    assert 0 < recovery_sum < 10
    assert value("springback_job_recovery_seconds", "springback_job_recovery_seconds_bucket",
                 le="+Inf") == 1
    assert 0 <= value("springback_job_goodput_ratio") <= 1
    assert "springback_job_checkpoint_age_seconds" in families  # declared, no sample before a commit


def test_json_logs_are_one_object_per_line():
    out = subprocess.run(
        [sys.executable, "-c", "import logging; from springback.service import logs; logs.configure();"
         "logging.getLogger('springback.test').warning('hello %s', 'world')"],
        capture_output=True, text=True, timeout=30,
        env={"SPRINGBACK_LOG_FORMAT": "json", "PATH": "/usr/bin:/bin"},
    )
    record = json.loads(out.stderr.strip())
    assert record["message"] == "hello world" and record["level"] == "WARNING"
    assert record["logger"] == "springback.test"


def test_a_non_leader_s_dashboard_lists_the_jobs_from_etcd_and_says_it_does_not_lead(
        start_coordinator, make_spec):
    from springback.client.api import Client

    leader = start_coordinator(token=OPERATOR_TOKEN)
    wait_for(leader.election.is_leader, 10, "leadership")
    follower = start_coordinator(token=OPERATOR_TOKEN, metrics_listen="127.0.0.1:0")
    with Client(leader.address, token=OPERATOR_TOKEN) as client:
        job = client.create_job(make_spec())
    request = urllib.request.Request(f"http://{follower.metrics_address}/",
                                     headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        page = response.read().decode()
    assert not follower.election.is_leader()
    assert f"<a href='/jobs/{job.id}'>{job.id}</a>" in page and "does not lead" in page
    wrong = urllib.request.Request(f"http://{follower.metrics_address}/jobs/{job.id}",
                                   headers={"Authorization": "Bearer nope"})
    try:
        urllib.request.urlopen(wrong, timeout=10)
        raise AssertionError("a wrong token was accepted")
    except urllib.error.HTTPError as e:
        assert e.code == 401
