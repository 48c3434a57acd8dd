"""Badput by cause from generation events (pure: `client.badput`)."""

from __future__ import annotations

import math

import pytest

from springback.client import badput
from springback.v1 import job_service_pb2 as js
from springback.v1 import types_pb2 as pb


def event(generation: int, created: float, *, action=pb.PLAN_ACTION_RUN,
          kind=js.CHANGE_KIND_JOIN, **fields) -> js.GenerationEvent:
    e = js.GenerationEvent(generation=generation, action=action, kind=kind, members=["a"])
    e.created_at.FromNanoseconds(int(created * 1e9))
    for name in ("started_at", "first_step_at", "last_step_at"):
        if name in fields:
            getattr(e, name).FromNanoseconds(int(fields.pop(name) * 1e9))
    for name, value in fields.items():
        setattr(e, name, value)
    return e


def test_a_failure_makes_detection_and_a_later_world_reforms_and_redoes():
    job = pb.Job()
    job.finished_at.FromSeconds(130)
    events = [
        event(1, 100, action=pb.PLAN_ACTION_WAIT, kind=js.CHANGE_KIND_START),
        event(2, 102, started_at=105, last_step_at=115, startup_s=1.0, rendezvous_s=0.5,
              transfer_s=0.25, checkpoint_stall_s=2.0),
        event(3, 118, kind=js.CHANGE_KIND_NODE_LOST, started_at=120, last_step_at=129,
              rendezvous_s=0.5, transfer_s=1.0, steps_redone=4, step_s=0.5),
        event(4, 130, action=pb.PLAN_ACTION_STOP, kind=js.CHANGE_KIND_FINISH),
    ]
    rows = badput.per_generation(job, events, now=999)
    c = [r[2] for r in rows]
    assert c[0]["waiting"] == 2
    # the first world: everything before its start is start-up
    assert c[1]["state_transfer"] == 0.25 and c[1]["startup"] == 2.75
    assert c[1]["checkpoint"] == 2 and c[1]["useful"] == 8 and c[1]["detection"] == 3
    # after the loss: rendezvous and the rest re-form, 4 steps redone
    assert c[2]["reforming"] == 1 and c[2]["state_transfer"] == 1
    assert c[2]["redone"] == 2 and c[2]["useful"] == 10 - 2 and c[2]["detection"] == 0
    total = badput.job_badput(job, events, now=999)
    assert total["wall_s"] == 30
    assert math.isclose(sum(total["causes"].values()), 30)


def test_rank_spans_longer_than_their_window_are_clipped():
    job = pb.Job()
    events = [event(1, 100, started_at=101, startup_s=50.0, transfer_s=0.5, last_step_at=101)]
    causes = badput.per_generation(job, events, now=104)[0][2]
    assert causes["state_transfer"] == 0.5 and causes["startup"] == 0.5
    assert causes["useful"] == 3 and math.isclose(sum(causes.values()), 4)


def test_a_negative_price_in_a_spec_file_is_named():
    import pytest

    from springback.client import spec as specs
    from springback.client.errors import InvalidArgument

    base = {"name": "a", "data": {"num_samples": 64, "global_batch_size": 8}, "max_steps": 10}
    assert specs.spec_from_dict({**base, "price_per_node_hour": 2}).price_per_node_hour == 2
    for bad, problem in ((-1, "negative"), ("3 EUR", "number"), (True, "number")):
        with pytest.raises(InvalidArgument) as e:
            specs.spec_from_dict({**base, "price_per_node_hour": bad})
        assert e.value.field == "price_per_node_hour" and problem in e.value.problem


def _kill_then_join() -> tuple[pb.Job, list[js.GenerationEvent]]:
    """A first world, a node lost (2 steps redone), a join, the end; every
    span a different value, so a column taking another's shows."""
    job = pb.Job()
    job.finished_at.FromSeconds(135)
    return job, [
        event(1, 100, action=pb.PLAN_ACTION_WAIT, kind=js.CHANGE_KIND_START),
        event(2, 101, started_at=104, first_step_at=104.5, last_step_at=110, startup_s=2.0),
        event(3, 113, kind=js.CHANGE_KIND_NODE_LOST, started_at=116, first_step_at=116.75,
              last_step_at=124, startup_s=0.25, rendezvous_s=0.5, transfer_s=1.25,
              steps_redone=2, step_s=0.5, step_p50_s=0.25),
        event(4, 126, started_at=128, first_step_at=128.5, last_step_at=135,
              rendezvous_s=1.5, transfer_s=0.125, step_s=0.5, step_p50_s=0.25),
        event(5, 135, action=pb.PLAN_ACTION_STOP, kind=js.CHANGE_KIND_FINISH),
    ]


def test_a_kill_and_a_join_are_split_into_where_their_time_went():
    job, events = _kill_then_join()
    kill, join = badput.change_costs(job, events, now=999)  # the first world is no change
    assert (kill.generation, kill.kind, kill.at_s, kill.started) == (3, "kill", 13, True)
    # detection: the first world's last step (110) to the loss's generation (113);
    # 3 s before the start report: 1.25 fill, 0.25 build, 0.5 rendezvous + 1.0 rest
    assert (kill.detection, kill.reforming, kill.build, kill.fill) == (3, 1.5, 0.25, 1.25)
    assert kill.waiting == 0 and not kill.waits
    # the first step: 0.75 s from the start report, the median step 0.25 s
    assert kill.first_step == 0.5 and kill.redone == 1.0 and kill.steps_redone == 2
    assert kill.total == 7.5
    # a join is no failure: the survivors trained until it was made
    assert (join.generation, join.kind, join.detection, join.build) == (4, "join", 0, 0)
    assert (join.reforming, join.fill, join.first_step, join.redone) == (1.875, 0.125, 0.25, 0)
    summary = badput.change_summary([kill, join])
    assert summary["kill"]["count"] == 1 and summary["kill"]["total"]["total"] == 7.5
    assert summary["join"]["mean"]["reforming"] == 1.875
    assert summary["kill"]["steps_redone"] == 2


# (the field set on the changed generation, its value, the column it must land in)
ONE_CAUSE = [("startup_s", 0.75, "build"), ("rendezvous_s", 0.75, "reforming"),
             ("transfer_s", 0.75, "fill"), ("steps_redone", 3, "redone")]


@pytest.mark.parametrize("field,value,column", ONE_CAUSE)
@pytest.mark.parametrize("kind", [js.CHANGE_KIND_NODE_LOST, js.CHANGE_KIND_RANK_FAILURE,
                                  js.CHANGE_KIND_JOIN])
def test_each_cause_lands_in_its_own_column_and_no_other(field, value, column, kind):
    # the change's generation starts the moment it is made, its predecessor's
    # last step report came when it was made: only `field` costs anything
    job = pb.Job()
    events = [event(1, 100, started_at=100, first_step_at=100.25, last_step_at=110,
                    step_p50_s=0.25),
              event(2, 110, kind=kind, started_at=110 + (value if field.endswith("_s") else 0),
                    last_step_at=120, step_s=0.25, **{field: value})]
    (cost,) = badput.change_costs(job, events, now=120)
    expected = value * 0.25 if column == "redone" else value
    assert {c: getattr(cost, c) for c in badput.CHANGE_COLUMNS} == {
        c: expected if c == column else (None if c == "first_step" else 0.0)
        for c in badput.CHANGE_COLUMNS}


@pytest.mark.parametrize("kind", [js.CHANGE_KIND_NODE_LOST, js.CHANGE_KIND_JOIN])
def test_only_a_failure_is_detected(kind):
    job = pb.Job()
    events = [event(1, 100, started_at=100, last_step_at=107),
              event(2, 110, kind=kind, started_at=110, last_step_at=120)]
    (cost,) = badput.change_costs(job, events, now=120)
    assert cost.detection == (3 if kind == js.CHANGE_KIND_NODE_LOST else 0)
    assert cost.reforming == cost.build == cost.fill == cost.redone == 0


def test_a_first_step_not_measured_is_none_not_zero():
    job = pb.Job()
    events = [
        event(1, 100, started_at=100, last_step_at=110),
        # no start report came: started_at is the first step's (the leader copies it)
        event(2, 110, kind=js.CHANGE_KIND_NODE_LOST, started_at=111, first_step_at=111,
              last_step_at=120, step_p50_s=0.25),
        # no step time reported
        event(3, 120, kind=js.CHANGE_KIND_JOIN, started_at=121, first_step_at=122,
              last_step_at=130),
        # replaced before its ranks started
        event(4, 130, kind=js.CHANGE_KIND_NODE_LOST),
        event(5, 131, kind=js.CHANGE_KIND_JOIN, started_at=132, first_step_at=133.5,
              last_step_at=140, step_p50_s=0.5),
    ]
    costs = badput.change_costs(job, events, now=140)
    assert [c.first_step for c in costs] == [None, None, None, 1.0]
    assert [c.started for c in costs] == [True, True, False, True]
    assert costs[2].reforming == 1  # the replaced generation's whole second
    summary = badput.change_summary(costs)
    assert summary["kill"]["first_step_measured"] == 0
    assert summary["kill"]["mean"]["first_step"] is None
    assert summary["join"]["mean"]["first_step"] == 1.0  # over the one that measured it
    assert summary["join"]["count"] == 2


def test_the_survivors_pause_is_read_against_the_median_step_of_the_last_generation_that_stepped():
    job, events = _kill_then_join()
    kill, join = badput.change_costs(job, events, now=999)
    # the kill: the first world's last step (110) to the loss's first (116.75);
    # that world reported no step time
    assert (kill.step_gap_s, kill.median_step_s, kill.gap_ratio) == (6.75, None, None)
    # the join: 124 to 128.5, against the loss generation's p50 (0.25), not its step_s
    assert (join.step_gap_s, join.median_step_s, join.gap_ratio) == (4.5, 0.25, 18.0)
    # across a WAIT generation (no step): against the generation before it
    events = [event(1, 100, started_at=100, last_step_at=110, step_s=0.5),
              event(2, 110.5, kind=js.CHANGE_KIND_NODE_LOST, action=pb.PLAN_ACTION_WAIT),
              event(3, 112.5, kind=js.CHANGE_KIND_JOIN, started_at=113, first_step_at=114,
                    last_step_at=120)]
    _, join = badput.change_costs(job, events, now=120)
    assert (join.step_gap_s, join.median_step_s, join.gap_ratio) == (4, 0.5, 8.0)


def test_a_kill_that_leaves_too_few_members_waits_for_the_join():
    job = pb.Job()
    events = [event(1, 100, started_at=100, last_step_at=110),
              event(2, 110.5, kind=js.CHANGE_KIND_NODE_LOST, action=pb.PLAN_ACTION_WAIT),
              event(3, 112.5, kind=js.CHANGE_KIND_JOIN, started_at=113, last_step_at=120)]
    kill, join = badput.change_costs(job, events, now=120)
    assert (kill.waits, kill.started, kill.detection, kill.waiting) == (True, False, 0.5, 2)
    assert kill.reforming == kill.build == kill.fill == kill.redone == 0
    assert kill.first_step is None and kill.total == 2.5
    assert (join.waits, join.waiting, join.reforming) == (False, 0, 0.5)


def test_the_first_world_and_other_changes_are_no_kill_or_join():
    job = pb.Job()
    events = [event(1, 100, action=pb.PLAN_ACTION_WAIT, kind=js.CHANGE_KIND_START),
              event(2, 101, kind=js.CHANGE_KIND_JOIN, started_at=102, last_step_at=110),
              event(3, 110, kind=js.CHANGE_KIND_DRAIN, started_at=111, last_step_at=115),
              event(4, 115, kind=js.CHANGE_KIND_OTHER, started_at=116, last_step_at=120)]
    assert badput.change_costs(job, events, now=120) == []
    assert badput.change_summary([]) == {}
