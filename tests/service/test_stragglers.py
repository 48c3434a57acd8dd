"""The straggler policy's decisions (service/policy/stragglers.py, spec
``controls.straggler``): pure, on hand-made per-member timing; and the
planner's side (a member set aside is planned as a spare, service/policy/replan.py)."""

from __future__ import annotations

import pytest

from springback.client.errors import InvalidArgument
from springback.client.spec import spec_from_dict
from springback.service.policy import replan, stragglers
from springback.service.policy.stragglers import Eviction, Stragglers
from springback.v1 import job_service_pb2 as js
from springback.v1 import types_pb2 as pb

pytestmark = pytest.mark.timeout(30)

BASE = {"name": "s", "min_workers": 2, "max_workers": 4,
        "data": {"num_samples": 1000, "global_batch_size": 8}, "max_steps": 10_000}


def _job(**policy) -> pb.Job:
    spec = spec_from_dict({**BASE, "controls": {"straggler": {"enabled": True, **policy}}})
    job = pb.Job(id="j", spec=spec)
    job.status.state = pb.JOB_STATE_RUNNING
    return job


def _timing(compute: dict[str, float], steps: int = 40) -> list[pb.MemberTiming]:
    return [pb.MemberTiming(member_id=m, compute_p50_s=c, collective_p50_s=0.01, num_steps=steps)
            for m, c in compute.items()]


FOUR = {"a": 0.10, "b": 0.11, "c": 0.10, "d": 0.21}
RANKS = {m: 1 for m in FOUR}


class TestSpec:
    def test_defaults_when_enabled_and_off_by_default(self):
        policy = _job().spec.controls.straggler
        assert (policy.factor, policy.window_steps, policy.cooldown_s) == (1.5, 30, 600)
        assert not spec_from_dict(BASE).controls.straggler.enabled

    @pytest.mark.parametrize("policy, field", [
        ({"enabled": True, "factor": 1.0}, "controls.straggler.factor"),
        ({"enabled": True, "factor": float("nan")}, "controls.straggler.factor"),
        ({"enabled": True, "window_steps": 0}, "controls.straggler.window_steps"),
        ({"enabled": True, "cooldown_s": -1}, "controls.straggler.cooldown_s"),
        ({"enabled": True, "change_cost_s": -2.0}, "controls.straggler.change_cost_s"),
        ({"enabled": True, "horizon_steps": 0}, "controls.straggler.horizon_steps"),
        ({"factor": 2.0}, "controls.straggler.factor"),
        ({"enabled": True, "fctor": 2.0}, "controls.straggler.fctor"),
        ({"enabled": "yes"}, "controls.straggler.enabled"),
    ])
    def test_a_bad_knob_is_refused_naming_its_field(self, policy, field):
        with pytest.raises(InvalidArgument) as e:
            spec_from_dict({**BASE, "controls": {"straggler": policy}})
        assert field in str(e.value)


class TestPolicy:
    def test_a_member_slow_on_every_report_for_the_window_is_due_and_not_before(self):
        job, s = _job(window_steps=30), Stragglers()
        policy = job.spec.controls.straggler
        assert s.due(policy, "j", 3, 100, _timing(FOUR)) is None  # its window starts
        assert s.due(policy, "j", 3, 129, _timing(FOUR)) is None
        assert s.due(policy, "j", 3, 130, _timing(FOUR)) == "d"

    def test_one_report_not_slow_or_a_new_generation_starts_the_window_afresh(self):
        job, s = _job(window_steps=30), Stragglers()
        policy = job.spec.controls.straggler
        s.due(policy, "j", 3, 100, _timing(FOUR))
        s.due(policy, "j", 3, 110, _timing({**FOUR, "d": 0.14}))  # 1.4 x: not slow
        assert s.due(policy, "j", 3, 135, _timing(FOUR)) is None
        assert s.due(policy, "j", 4, 170, _timing(FOUR)) is None  # another generation
        assert s.due(policy, "j", 4, 199, _timing(FOUR)) is None
        assert s.due(policy, "j", 4, 200, _timing(FOUR)) == "d"

    def test_a_healthy_spread_a_short_median_or_a_lone_member_is_never_due(self):
        job, s = _job(window_steps=10), Stragglers()
        policy = job.spec.controls.straggler
        healthy = {"a": 0.10, "b": 0.14, "c": 0.09, "d": 0.12}
        for step in range(0, 200, 5):
            assert s.due(policy, "j", 1, step, _timing(healthy)) is None
            assert s.due(policy, "j", 2, step, _timing(FOUR, steps=5)) is None
            assert s.due(policy, "j", 3, step, _timing({"a": 0.5})) is None
        assert s.due(_job().spec.controls.straggler.__class__(), "j", 5, 0, _timing(FOUR)) is None

    def test_evicted_when_the_saving_over_the_steps_left_beats_a_change_with_both_figures(self):
        job, s = _job(window_steps=10, change_cost_s=20), Stragglers()
        s.due(job.spec.controls.straggler, "j", 3, 100, _timing(FOUR))
        s.due(job.spec.controls.straggler, "j", 3, 110, _timing(FOUR))
        # no spare: the 3 others compute 4/3 as much each (the global batch stays)
        out = s.judge(job, "d", 110, _timing(FOUR), RANKS, [], [])
        assert isinstance(out, Eviction) and not out.spare
        assert out.median_s == pytest.approx(0.10)
        assert out.gain_s == pytest.approx(0.21 - 0.10 * 4 / 3)
        assert out.steps_left == 9890 and out.saving_s > 20
        said = out.reason(600)
        assert "set aside d" in said and "210.0 ms" in said and "100.0 ms" in said
        assert "steps 100-110" in said and "20.0 s (controls.straggler.change_cost_s)" in said
        with_spare = s.judge(job, "d", 110, _timing(FOUR), RANKS, ["e"], [])
        assert isinstance(with_spare, Eviction) and with_spare.gain_s == pytest.approx(0.11)

    def test_it_stays_when_the_job_is_not_faster_without_it(self):
        s = Stragglers()
        near_end = _job(change_cost_s=20)
        out = s.judge(near_end, "d", 9_990, _timing(FOUR), RANKS, [], [])
        assert isinstance(out, str) and "stays" in out and "not above" in out  # 10 steps left
        horizon = _job(change_cost_s=20, horizon_steps=100)
        assert isinstance(s.judge(horizon, "d", 100, _timing(FOUR), RANKS, [], []), str)
        # 1.6 x on 2 members with no spare: the survivor computes 2 x: slower
        two = s.judge(_job(), "b", 100, _timing({"a": 0.1, "b": 0.16}), {"a": 1, "b": 1}, [], [])
        assert isinstance(two, str)
        job = _job()
        job.spec.min_workers = 4
        assert "min_workers" in s.judge(job, "d", 100, _timing(FOUR), RANKS, [], [])

    def test_the_change_cost_is_the_spec_s_else_measured_recoveries_else_the_default(self):
        policy = _job().spec.controls.straggler
        assert stragglers.change_cost(policy, [])[0] == stragglers.DEFAULT_CHANGE_COST_S
        events = [js.GenerationEvent(kind=js.CHANGE_KIND_START)]
        events[0].recovery.FromMilliseconds(90_000)  # a cold start is not a change
        for kind, ms in ((js.CHANGE_KIND_NODE_LOST, 4000), (js.CHANGE_KIND_JOIN, 2000),
                         (js.CHANGE_KIND_JOIN, 3000)):
            e = js.GenerationEvent(kind=kind)
            e.recovery.FromMilliseconds(ms)
            events.append(e)
        assert stragglers.change_cost(policy, events) == (3.0, "median recovery of the last "
                                                          "3 changes")
        policy.change_cost_s = 7
        assert stragglers.change_cost(policy, events)[0] == 7

    def test_a_member_set_aside_again_waits_twice_as_long_then_returns(self):
        status = pb.JobStatus()
        assert stragglers.set_aside(status, "d", 1000.0, 60) == 60
        assert stragglers.active(status) == {"d"}
        assert stragglers.returns(status, 1059.0) == [] and stragglers.returns(status, 1060) == ["d"]
        stragglers.mark_returned(status, ["d"])
        assert stragglers.active(status) == set()
        assert stragglers.set_aside(status, "d", 2000.0, 60) == 120
        assert stragglers.returns(status, 2119.0) == []


class TestPlanned:
    def _replan(self, job: pb.Job, members: list[pb.Member], previous: pb.Plan | None):
        return replan.replan(replan.Inputs(
            job=job, previous=previous, previous_signature=None, members=members,
            checkpoints=[], progress=None, reason="r"))

    def test_a_member_set_aside_is_a_spare_its_place_taken_by_a_spare_or_the_world_smaller(self):
        members = [pb.Member(id=m, host="h", num_local_ranks=1, join_order=i)
                   for i, m in enumerate("abcde")]
        job = _job()
        job.spec.max_workers = 4
        first = self._replan(job, [pb.Member.FromString(m.SerializeToString())
                                   for m in members], None).plan
        assert [m.member_id for m in first.members] == list("abcd") and list(first.spares) == ["e"]
        stragglers.set_aside(job.status, "b", 0.0, 60)
        fresh = [pb.Member.FromString(m.SerializeToString()) for m in members]
        plan = self._replan(job, fresh, first).plan
        assert [m.member_id for m in plan.members] == ["a", "e", "c", "d"]
        assert set(plan.spares) == {"b"} and set(job.status.spares) == {"b"}
        fresh = [pb.Member.FromString(m.SerializeToString()) for m in members[:4]]
        plan = self._replan(job, fresh, first).plan  # no spare: a world of three
        assert sorted(m.member_id for m in plan.members) == ["a", "c", "d"]
        assert list(plan.spares) == ["b"]
        stragglers.mark_returned(job.status, ["b"])
        plan = self._replan(job, [pb.Member.FromString(m.SerializeToString())
                                  for m in members[:4]], plan).plan
        assert sorted(m.member_id for m in plan.members) == list("abcd")
