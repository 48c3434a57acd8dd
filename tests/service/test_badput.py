"""Badput by cause from generation events (pure: `client.badput`)."""

from __future__ import annotations

import math

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
