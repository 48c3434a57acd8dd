"""The coordinator's Prometheus endpoint and structured logs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sbtest import scrape, wait_for

pytestmark = pytest.mark.timeout(60)


def test_metrics_show_leadership_jobs_and_generations(start_coordinator, make_spec):
    from springback.service.client import Client

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
