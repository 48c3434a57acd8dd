"""The training library against hand-written plans (real gloo, no coordinator)."""

from __future__ import annotations

import signal
import time

import pytest

from fakeplans import assert_replicas_identical
from springback.worker import env as E
from springback.worker.audit import check_exactly_once


def _finish(job, members, timeout_s=90):
    deadline = time.monotonic() + timeout_s
    for m in members:
        left = max(deadline - time.monotonic(), 0.1)
        assert job.procs[m].wait(timeout=left) == 0, f"{m} failed, see {job.root}/{m}.log"


@pytest.mark.timeout(120)
class TestGenerationSwitch:
    def test_survivors_of_a_killed_peer_finish_with_identical_state_and_exact_samples(
            self, fake_job):
        for m in ("a", "b", "c"):
            fake_job.spawn(m)
        fake_job.publish(["a", "b", "c"], "start")
        fake_job.wait_step(8)
        fake_job.procs["b"].send_signal(signal.SIGKILL)
        fake_job.procs["b"].wait()
        fake_job.publish(["a", "c"], "b died")
        _finish(fake_job, ["a", "c"])
        report = check_exactly_once(fake_job.audit_dir, num_samples=256,
                                    global_batch_size=12, last_step=40)
        assert report.ok, report
        assert report.generations[-1] == 2
        assert assert_replicas_identical(fake_job.audit_dir) >= 2
        worlds = {r["world_size"] for r in fake_job.steps()}
        assert worlds == {3, 2}

    def test_a_joiner_is_admitted_at_a_step_boundary_and_receives_the_state(self, fake_job):
        for m in ("a", "b"):
            fake_job.spawn(m)
        fake_job.publish(["a", "b"], "start")
        fake_job.wait_step(6)
        fake_job.spawn("c")
        fake_job.publish(["a", "b", "c"], "c joined")
        _finish(fake_job, ["a", "b", "c"])
        report = check_exactly_once(fake_job.audit_dir, num_samples=256,
                                    global_batch_size=12, last_step=40)
        assert report.ok, report
        assert assert_replicas_identical(fake_job.audit_dir) >= 2
        steps = fake_job.steps()
        # no step was lost or redone at the switch: each step reported once
        assert sorted(r["step"] for r in steps) == list(range(1, 41))
        first_joined = min(r["step"] for r in steps if r["world_size"] == 3)
        assert first_joined > 6


@pytest.mark.timeout(90)
def test_a_generation_that_cannot_start_and_gets_no_newer_plan_fails_the_rank(fake_job):
    # b never comes: a gives up the rendezvous after 2 s, then waits the grace
    # (15 s) for a newer plan; none comes, so it exits with an error for its
    # agent to report, instead of waiting forever
    proc = fake_job.spawn("a", {E.RENDEZVOUS_TIMEOUT_S: "2"})
    fake_job.publish(["a", "b"], "b never starts")
    assert proc.wait(timeout=60) != 0
    log = (fake_job.root / "a.log").read_text()
    assert "generation 1 could not start and no newer plan came within 15s" in log, log
