"""`checkpoint.every_steps: auto`: the Young-Daly choice (pure) and the plan
that carries it (a real coordinator on a real etcd)."""

from __future__ import annotations

import math

import pytest

from sbtest import wait_for
from springback.client import spec as specs
from springback.client.errors import InvalidArgument
from springback.service.policy import ckptinterval
from springback.service.policy.ckptinterval import Observed
from springback.v1 import types_pb2 as pb
from springback.v1 import worker_service_pb2 as ws

pytestmark = pytest.mark.timeout(60)


def auto_spec(**checkpoint) -> pb.JobSpec:
    return specs.spec_from_dict({
        "name": "auto", "data": {"num_samples": 1024, "global_batch_size": 32},
        "max_steps": 100_000,
        "checkpoint": {"uri": "/tmp/ckpt", "every_steps": "auto", **checkpoint}})


class TestChoice:
    def test_two_failure_rates_move_the_interval_as_sqrt_of_mtbf(self):
        spec = auto_spec()
        often = ckptinterval.choose(spec, Observed(running_s=4000, failures=60, rollbacks=40,
                                                   cost_s=2.0, step_s=0.1))
        rarely = ckptinterval.choose(spec, Observed(running_s=4000, failures=60, rollbacks=10,
                                                    cost_s=2.0, step_s=0.1))
        assert often.mtbf_s == 100 and rarely.mtbf_s == 400
        # sqrt(2 * 2 * 100) = 20 s = 200 steps; four times the MTBF: twice the interval
        assert often.every_steps == 200 and rarely.every_steps == 400
        assert "Young-Daly" in often.basis and "40 rollbacks in 60 failures" in often.basis
        assert often.rollbacks == 40 and often.failures == 60

    def test_failures_recovered_live_do_not_shorten_it(self):
        # checkpoints insure against rollbacks only: 40 failures the
        # survivors recovered from memory leave the prior, lengthened by the run
        spec = auto_spec(mtbf_prior_s=600)
        live = ckptinterval.choose(spec, Observed(running_s=4000, failures=40, cost_s=2.0,
                                                  step_s=0.1))
        assert live.mtbf_s == 4600 and live.rollbacks == 0
        assert live.every_steps == round(math.sqrt(2 * 2.0 * 4600) / 0.1)
        assert "no rollback yet (40 failures" in live.basis

    def test_the_cost_moves_it_too_and_the_bounds_hold(self):
        spec = auto_spec(min_every_steps=50, max_every_steps=300)
        seen = Observed(running_s=4000, failures=40, rollbacks=40, step_s=0.1)
        assert ckptinterval.choose(spec, Observed(**{**seen.__dict__, "cost_s": 8.0})).every_steps == 300
        assert ckptinterval.choose(spec, Observed(**{**seen.__dict__, "cost_s": 0.02})).every_steps == 50
        mid = ckptinterval.choose(spec, Observed(**{**seen.__dict__, "cost_s": 0.5}))
        assert mid.every_steps == 100  # sqrt(2 * 0.5 * 100) = 10 s

    def test_the_prior_until_a_failure_and_the_initial_interval_until_measured(self):
        spec = auto_spec(mtbf_prior_s=800, min_every_steps=5)
        prior = ckptinterval.choose(spec, Observed(running_s=100, failures=0, cost_s=1.0,
                                                   step_s=1.0))
        assert prior.mtbf_s == 900 and prior.every_steps == round(math.sqrt(2 * 900))
        unmeasured = ckptinterval.choose(spec, Observed(running_s=100, failures=3))
        assert unmeasured.every_steps == 100 and "not measured" in unmeasured.basis
        bounded = ckptinterval.choose(auto_spec(min_every_steps=150), Observed())
        assert bounded.every_steps == 150

    def test_a_plan_of_a_fixed_interval_job_is_left_alone(self):
        plan = pb.Plan(action=pb.PLAN_ACTION_RUN)
        plan.spec.checkpoint.every_steps = 7
        assert ckptinterval.apply(plan, Observed(failures=1, cost_s=1, step_s=1)) is None
        assert plan.spec.checkpoint.every_steps == 7


class TestSpec:
    @pytest.mark.parametrize("checkpoint, field", [
        ({"every_steps": "often"}, "checkpoint.every_steps"),
        ({"every_steps": "auto", "min_every_steps": 9, "max_every_steps": 3},
         "checkpoint.min_every_steps"),
        ({"every_steps": 10, "max_every_steps": 30}, "checkpoint.max_every_steps"),
    ])
    def test_bad_auto_fields_are_named(self, checkpoint, field):
        with pytest.raises(InvalidArgument) as e:
            specs.spec_from_dict({"name": "a", "data": {"num_samples": 64, "global_batch_size": 8},
                                  "max_steps": 10, "checkpoint": {"uri": "/tmp/c", **checkpoint}})
        assert e.value.field == field


def test_each_run_plan_carries_the_interval_chosen_from_what_was_measured(
        coordinator, client, workers, make_spec):
    job = client.create_job(make_spec(
        min_workers=1, max_workers=2, max_steps=100_000,
        checkpoint={"uri": "/tmp/ckpt", "every_steps": "auto", "max_every_steps": 3000}))
    a = workers.JoinJob(ws.JoinJobRequest(job_id=job.id, host="127.0.0.1", rendezvous_port=5101,
                                          num_local_ranks=1), timeout=10).member.id
    first = coordinator.coordinator.current_plan(job.id)
    assert first.action == pb.PLAN_ACTION_RUN
    assert first.spec.checkpoint.every_steps == 100  # nothing measured: the initial interval
    workers.ReportStep(ws.ReportStepRequest(
        job_id=job.id, member_id=a, generation=first.generation, step=0, generation_start=True,
        restored_from=pb.RESTORE_KIND_NONE), timeout=5)
    for step in range(1, 30):  # a step time and a stall to choose from
        workers.ReportStep(ws.ReportStepRequest(
            job_id=job.id, member_id=a, generation=first.generation, step=step,
            checkpoint_stall_s=0.5), timeout=5)
    workers.ReportFailure(ws.ReportFailureRequest(
        job_id=job.id, member_id=a, generation=first.generation, reason="rank 0 exited 1"),
        timeout=5)
    wait_for(lambda: coordinator.coordinator.current_plan(job.id).generation > first.generation,
             10, "the generation after the failure")
    plan = coordinator.coordinator.current_plan(job.id)
    _, events = client.list_job_events(job.id)
    chosen = next(e for e in events if e.generation == plan.generation).checkpoint_interval
    assert chosen.failures == 1 and chosen.cost_s == 0.5 and chosen.step_s > 0
    assert chosen.rollbacks == 0  # nothing started yet after the failure
    assert "Young-Daly" in chosen.basis
    expected = ckptinterval.choose(plan.spec, Observed(
        running_s=chosen.mtbf_s - ckptinterval.DEFAULT_MTBF_PRIOR_S, failures=1,
        cost_s=chosen.cost_s, step_s=chosen.step_s))
    assert plan.spec.checkpoint.every_steps == chosen.every_steps == expected.every_steps
    by_generation = {e.generation: e for e in events}
    assert by_generation[first.generation].checkpoint_interval.every_steps == 100
    assert not by_generation[1].HasField("checkpoint_interval")  # the WAIT plan: none
    # a start that went back to step 20 (9 steps redone) is a rollback: the
    # next failure's interval comes from the time between rollbacks
    workers.ReportStep(ws.ReportStepRequest(
        job_id=job.id, member_id=a, generation=plan.generation, step=20, generation_start=True,
        restored_from=pb.RESTORE_KIND_CHECKPOINT), timeout=5)
    assert client.get_job(job.id).status.steps_redone == 9
    workers.ReportFailure(ws.ReportFailureRequest(
        job_id=job.id, member_id=a, generation=plan.generation, reason="rank 0 exited 1"),
        timeout=5)
    wait_for(lambda: coordinator.coordinator.current_plan(job.id).generation > plan.generation,
             10, "the generation after the second failure")
    third = coordinator.coordinator.current_plan(job.id)
    _, events = client.list_job_events(job.id)
    chosen = next(e for e in events if e.generation == third.generation).checkpoint_interval
    assert chosen.failures == 2 and chosen.rollbacks == 1, chosen
    assert chosen.mtbf_s < ckptinterval.DEFAULT_MTBF_PRIOR_S  # the running time, no prior
    assert "1 rollbacks in 2 failures" in chosen.basis
