"""The bad-step policy (spec ``controls.bad_step``, worker/train/badstep.py) on
two real gloo ranks of tiny_train.py: driven by hand-written plans (the step
vote carries one rank's non-finite loss to every rank), and end to end with
real etcd, a real coordinator and a real agent (the pause)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from cluster import AgentProcess
from fakeplans import FakeJob
from sbtest import wait_for

from springback.v1 import job_service_pb2 as js
from springback.v1 import types_pb2 as pb

from springback.worker.train.audit import check_exactly_once
from springback.worker.train.badstep import locally_bad
from springback.worker.train.sampler import SampleStream

MEMBERS = ["a", "b"]


def _job(tmp_path: Path, max_steps: int) -> FakeJob:
    job = FakeJob(tmp_path, max_steps=max_steps)
    policy = job.spec.controls.bad_step
    policy.enabled, policy.max_in_window, policy.window_steps = True, 3, 10
    return job


def _digests(audit_dir: str, rank: int) -> dict[int, str]:
    path = next(Path(audit_dir).glob(f"digests-r{rank}-p*.jsonl"))
    return {r["step"]: r["digest"] for r in map(json.loads, path.read_text().splitlines())}


class TestLocalVerdict:
    @pytest.mark.timeout(10)
    def test_a_rank_judges_its_loss_and_every_gradient_its_modules_hold(self):
        model = torch.nn.Linear(2, 1)
        assert not locally_bad(1.0, [model])  # no gradient yet
        model(torch.ones(1, 2)).sum().backward()
        assert not locally_bad(1.0, [model]) and not locally_bad(None, [model])
        assert locally_bad(float("inf"), [model])
        model.bias.grad[0] = float("nan")
        assert locally_bad(1.0, [model]) and locally_bad(None, [model])


class TestBadSteps:
    @pytest.mark.timeout(120)
    def test_a_nan_on_one_rank_is_applied_by_no_rank_and_its_batch_is_named_skipped(
            self, tmp_path):
        job = _job(tmp_path, max_steps=10)
        try:
            for m in MEMBERS:
                job.spawn(m, {"TINY_NAN_STEPS": "5", "TINY_NAN_RANK": "1", "TINY_DIGESTS": "1"})
            job.publish(MEMBERS)
            job.finish(MEMBERS)
        finally:
            job.close()
        digests = [_digests(job.audit_dir, r) for r in range(2)]
        assert digests[0] == digests[1] and sorted(digests[0]) == list(range(1, 11))
        d = digests[0]
        assert d[5] == d[4], "step 5 changed the state"  # SHA-256 of the model's tensors
        assert len({d[s] for s in (4, 6, 7, 8, 9, 10)}) == 6, "training did not go on"
        report = check_exactly_once(job.audit_dir, num_samples=256, global_batch_size=12,
                                    last_step=10)
        assert report.ok and report.skipped_steps == [5], report
        # the sample counter (tiny_train.py): step 5's samples never reached
        # the optimizer, every other step's exactly once
        stream = SampleStream(num_samples=256, global_batch_size=12)
        skipped = set(stream.batch(5, 1, 0).indices.tolist())
        for path in Path(job.audit_dir).glob("applied-p*.json"):
            counter = json.loads(path.read_text())["counter"]
            for step in range(1, 11):
                for i in stream.batch(step, 1, 0).indices.tolist():
                    assert round(counter[i]) == (0 if i in skipped else 1), (step, i)
        for m in MEMBERS:  # rank 0's loss was finite: it learned of step 5 from the vote
            assert "step 5 is not applied" in job.log_tail(m, 200_000), job.log_tail(m)

    @pytest.mark.timeout(120)
    def test_a_loss_spike_on_one_rank_is_applied_by_no_rank_once_its_window_is_full(
            self, tmp_path):
        """tiny_train's per-sample loss is ~0.1-1 here: 1e6 at steps 3 and 12
        on rank 1 is a spike against a median of 5 steps, but step 3 comes
        before the window is full (judged by no one: applied)."""
        job = _job(tmp_path, max_steps=14)
        policy = job.spec.controls.bad_step
        policy.loss_spike_factor, policy.loss_window_steps = 10.0, 5
        try:
            for m in MEMBERS:
                job.spawn(m, {"TINY_NAN_STEPS": "3,12", "TINY_NAN_RANK": "1",
                              "TINY_BAD_LOSS": "1e6", "TINY_DIGESTS": "1"})
            job.publish(MEMBERS)
            job.finish(MEMBERS)
        finally:
            job.close()
        digests = [_digests(job.audit_dir, r) for r in range(2)]
        assert digests[0] == digests[1] and sorted(digests[0]) == list(range(1, 15))
        d = digests[0]
        assert d[12] == d[11] and d[3] != d[2], "step 12 applied or step 3 not"
        report = check_exactly_once(job.audit_dir, num_samples=256, global_batch_size=12,
                                    last_step=14)
        assert report.ok and report.skipped_steps == [12], report
        said = job.log_tail("b", 200_000)  # the rank that judged it says why, with figures
        assert "step 12: this rank's loss 1e+06 is above 10 x the median" in said, said
        assert "step 12 is not applied" in job.log_tail("a", 200_000)

    @pytest.mark.timeout(120)
    def test_too_many_bad_steps_in_the_window_stop_every_rank_naming_the_steps(self, tmp_path):
        job = _job(tmp_path, max_steps=20)
        try:
            for m in MEMBERS:
                job.spawn(m, {"TINY_NAN_STEPS": "3,4,9", "TINY_NAN_RANK": "0"})
            job.publish(MEMBERS)
            codes = [job.procs[m].wait(timeout=100) for m in MEMBERS]
        finally:
            job.close()
        assert codes == [1, 1], [job.log_tail(m) for m in MEMBERS]
        for m in MEMBERS:  # no coordinator to pause the job: every rank stops with the reason
            said = job.log_tail(m)
            assert "BadStepLimit: controls.bad_step: 3 steps with a non-finite loss or " \
                   "gradient within the last 10 steps (steps 3, 4, 9; " in said, said
        report = check_exactly_once(job.audit_dir, num_samples=256, global_batch_size=12,
                                    last_step=8)
        assert report.ok and report.skipped_steps == [3, 4], report


class TestBadStepsEndToEnd:
    """Real etcd, a real coordinator and a real node agent with two ranks."""

    @pytest.mark.timeout(120)
    def test_a_persistent_nan_pauses_the_job_naming_the_steps(self, tmp_path, client,
                                                              coordinator_address):
        spec = {"name": "nan", "data": {"num_samples": 256, "global_batch_size": 12},
                "max_steps": 100_000,
                "controls": {"bad_step": {"enabled": True, "max_in_window": 3,
                                          "window_steps": 10}}}
        job_id = client.create_job(spec).id
        agent = AgentProcess(tmp_path, "a", job_id, coordinator_address, nproc=2,
                             env={"TINY_NAN_FROM_STEP": "6",
                                  "TINY_NAN_RANK": "1", "TINY_STEP_SLEEP_S": "0.05"})
        try:
            job = wait_for(lambda: (lambda j: j if j.status.state not in (
                pb.JOB_STATE_PENDING, pb.JOB_STATE_RUNNING) else None)(client.get_job(job_id)),
                90, "the job to pause")
        finally:
            agent.signal_node(signal.SIGKILL)
            agent.wait(30)
        said = job.status.message
        assert job.status.state == pb.JOB_STATE_PAUSED, said
        assert said == ("controls.bad_step: 3 steps with a non-finite loss or gradient within "
                        "the last 10 steps (steps 6, 7, 8; none applied, their batches "
                        "skipped), the limit is 3 (controls.bad_step.max_in_window): paused"), said
        _, events = client.list_job_events(job_id)
        assert events[-1].kind == js.CHANGE_KIND_CONTROL and events[-1].reason == said
