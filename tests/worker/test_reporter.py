"""Rank 0's step reports (worker/train/reporter.py) against a real coordinator."""

from __future__ import annotations

import time

import grpc
import pytest

from sbtest import wait_for
from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as ws
from springback.v1 import worker_service_pb2_grpc as ws_grpc
from springback.worker.train.reporter import STEP_REPORT_INTERVAL_S, StepReporter

pytestmark = pytest.mark.timeout(60)
REPORT_STEP = "/springback.v1.WorkerService/ReportStep"


def test_step_reports_go_out_at_most_once_an_interval_and_a_flush_sends_the_newest_at_once(
        coordinator, client, make_spec):
    job = client.create_job(make_spec(min_workers=1, max_workers=1, max_steps=10_000))
    with grpc.insecure_channel(coordinator.address) as channel:
        workers = ws_grpc.WorkerServiceStub(channel)
        member = workers.JoinJob(ws.JoinJobRequest(
            job_id=job.id, host="127.0.0.1", rendezvous_port=9400, num_local_ranks=1),
            timeout=10).member.id
        generation = coordinator.coordinator.current_plan(job.id).generation
        reporter = StepReporter(coordinator.address, None, job.id, member)
        try:
            reporter.start(generation=generation, step=0, samples_consumed=0,
                           restored_from=pb.RESTORE_KIND_NONE, epoch=0, offset=0)
            assert reporter.flush()
            before = coordinator.counter.calls[REPORT_STEP]
            t0 = time.monotonic()
            for step in range(1, 61):  # a step every 10 ms: far more often than the interval
                reporter.submit(generation=generation, step=step, samples_consumed=step,
                                loss=1.0, epoch=0, offset=step)
                time.sleep(0.01)  # the steps' own pace, not a synchronisation
            elapsed = time.monotonic() - t0
            sent = coordinator.counter.calls[REPORT_STEP] - before
            assert 1 <= sent <= 2 + elapsed / STEP_REPORT_INTERVAL_S, (sent, elapsed)
            assert sent < 60 / 4, "not one report per step"
            assert reporter.flush()  # the newest goes out now, not after the interval
            assert client.get_job(job.id).status.step == 60
            wait_for(lambda: reporter.accepted == (generation, 60), 5, "the report to be taken")
        finally:
            reporter.close()
