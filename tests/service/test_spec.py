"""Job spec parsing: every bad input is an InvalidArgument naming its field."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from springback.client.errors import InvalidArgument
from springback.client.spec import load_spec_file, spec_from_dict
from springback.v1 import types_pb2 as pb

pytestmark = pytest.mark.timeout(60)

GOOD = {"name": "lm", "data": {"num_samples": 10, "global_batch_size": 2}, "max_steps": 3}


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"name": None}, "name"),
        ({"name": 3}, "name"),
        ({"max_steps": -1}, "max_steps"),
        ({"max_steps": True}, "max_steps"),
        ({"data": None}, "data"),
        ({"data": [1]}, "data"),
        ({"data": {"num_samples": 10}}, "data.global_batch_size"),
        ({"layout": {"tp": "2"}}, "layout.tp"),
        ({"layout": {"dp": 2}}, "layout.dp"),
        ({"layout": {"pp": 2, "min_pp": 3}}, "layout.min_pp"),
        ({"layout": {"min_pp": "2"}}, "layout.min_pp"),
        ({"checkpoint": {"every_steps": 5}}, "checkpoint.uri"),
        ({"workers": 3}, "workers"),
        ({"peer_copies": {"every_steps": -1}}, "peer_copies.every_steps"),
        ({"peer_copies": {"every_steps": "10"}}, "peer_copies.every_steps"),
        ({"peer_copies": {"every": 10}}, "peer_copies.every"),
        ({"peer_copies": 10}, "peer_copies"),
        ({"failures": {"on_state_lost": "ignore"}}, "failures.on_state_lost"),
        ({"failures": {"on_state_lost": ["fail"]}}, "failures.on_state_lost"),
        ({"data": {"num_samples": 10, "global_batch_size": 2**40}}, "data.global_batch_size"),
        ({"failures": {"storage_outage_s": -1}}, "failures.storage_outage_s"),
        ({"failures": {"storage_outage_s": "1h"}}, "failures.storage_outage_s"),
        ({"failures": {"storage_outage_s": 8 * 24 * 3600}}, "failures.storage_outage_s"),
        ({"failures": {"storage_outage_s": 2**40}}, "failures.storage_outage_s"),
    ],
)
def test_bad_keys_are_named(patch, field):
    with pytest.raises(InvalidArgument) as e:
        spec_from_dict({**GOOD, **patch})
    assert e.value.field == field


def test_defaults_are_filled_in():
    spec = spec_from_dict({**GOOD, "checkpoint": {"uri": "s3://b/p"}})
    assert (spec.min_workers, spec.max_workers, spec.layout.tp, spec.checkpoint.keep_last) == (1, 1, 1, 3)


def test_peer_copies_default_to_every_10_steps_and_0_disables_them():
    assert spec_from_dict(GOOD).peer_copies.every_steps == 10
    off = spec_from_dict({**GOOD, "peer_copies": {"every_steps": 0}})
    assert off.peer_copies.HasField("every_steps") and off.peer_copies.every_steps == 0
    assert spec_from_dict({**GOOD, "peer_copies": {"every_steps": 3}}).peer_copies.every_steps == 3


def test_a_job_waits_half_an_hour_for_its_store_unless_the_spec_says_otherwise():
    assert spec_from_dict(GOOD).failures.storage_outage_s == 1800
    assert spec_from_dict({**GOOD, "failures": {"storage_outage_s": 60}}).failures.storage_outage_s == 60


def test_a_state_loss_restarts_unless_the_spec_says_fail():
    assert spec_from_dict(GOOD).failures.on_state_lost == pb.STATE_LOST_POLICY_RESTART
    fail = spec_from_dict({**GOOD, "failures": {"on_state_lost": "fail"}})
    assert fail.failures.on_state_lost == pb.STATE_LOST_POLICY_FAIL


def test_a_bad_peer_copy_interval_names_the_field_and_the_file(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("name: lm\ndata: {num_samples: 10, global_batch_size: 2}\nmax_steps: 3\n"
                    "peer_copies: {every_steps: -5}\n")
    with pytest.raises(InvalidArgument) as e:
        load_spec_file(str(path))
    assert e.value.field == "peer_copies.every_steps"
    assert "must not be negative, got -5" in str(e.value) and "job.yaml" in str(e.value)


def test_unreadable_and_malformed_files_name_the_file(tmp_path):
    with pytest.raises(InvalidArgument) as e:
        load_spec_file(str(tmp_path / "missing.yaml"))
    assert "missing.yaml" in str(e.value)
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    with pytest.raises(InvalidArgument) as e:
        load_spec_file(str(broken))
    assert "broken.yaml" in str(e.value) and "YAML" in str(e.value)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 2**70) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from([*GOOD, "layout", "checkpoint", "min_workers", "x"]),
                       json_values, max_size=6))
def test_arbitrary_input_is_accepted_or_rejected_cleanly(value):
    try:
        spec_from_dict(value)
    except InvalidArgument as e:
        assert e.field  # never a crash, always a named field


def test_a_pipeline_keeps_its_stage_count_unless_the_spec_lets_it_shrink():
    assert spec_from_dict({**GOOD, "layout": {"pp": 4}}).layout.min_pp == 4
    assert spec_from_dict({**GOOD, "layout": {"pp": 4, "min_pp": 2}}).layout.min_pp == 2


class TestStopRules:
    @pytest.mark.parametrize(
        ("stop", "field", "said"),
        [
            ({"goodput_floor": 80}, "controls.stop.goodput_floor", "80 % is 0.8"),
            ({"goodput_floor": -0.1}, "controls.stop.goodput_floor", "must not be negative"),
            ({"goodput_floor": 0}, "controls.stop.goodput_floor", "turn the rule off"),
            ({"goodput_floor": "high"}, "controls.stop.goodput_floor", "must be a number"),
            ({"goodput_floor": 0.8, "window_s": 0}, "controls.stop.window_s", "must be positive"),
            ({"goodput_floor": 0.8, "window_s": -5}, "controls.stop.window_s", "negative"),
            ({"window_s": 60}, "controls.stop.window_s", "only meaningful"),
            ({"no_progress_s": 60, "action": "retry"}, "controls.stop.action", "pause, fail"),
            ({"cost_per_step_ceiling": 0.5}, "controls.stop.cost_per_step_ceiling",
             "price_per_node_hour"),
            ({"after": 3}, "controls.stop.after", "unknown key"),
        ],
    )
    def test_a_bad_stop_rule_names_its_field(self, stop, field, said):
        with pytest.raises(InvalidArgument) as e:
            spec_from_dict({**GOOD, "controls": {"stop": stop}})
        assert e.value.field == field and said in str(e.value)

    def test_every_rule_is_off_unless_the_spec_sets_it(self):
        assert spec_from_dict(GOOD).controls.stop == pb.StopRules()

    def test_a_goodput_floor_watches_five_minutes_and_pauses_unless_told_otherwise(self):
        stop = spec_from_dict({**GOOD, "controls": {"stop": {"goodput_floor": 0.8}}}).controls.stop
        assert (stop.window_s, stop.action) == (300, pb.STOP_ACTION_PAUSE)
        stop = spec_from_dict({**GOOD, "price_per_node_hour": 2.0, "controls": {"stop": {
            "cost_per_step_ceiling": 0.01, "no_progress_s": 60, "window_s": 30,
            "action": "fail"}}}).controls.stop
        assert (stop.window_s, stop.no_progress_s, stop.action) == (30, 60, pb.STOP_ACTION_FAIL)


class TestBadStepPolicy:
    @pytest.mark.parametrize(
        ("bad_step", "field", "said"),
        [
            ({"enabled": "yes"}, "controls.bad_step.enabled", "true or false"),
            ({"enabled": True, "max_in_window": 0}, "controls.bad_step.max_in_window",
             "must be positive"),
            ({"enabled": True, "window_steps": -3}, "controls.bad_step.window_steps", "negative"),
            ({"enabled": True, "window_steps": 2.5}, "controls.bad_step.window_steps",
             "must be an integer"),
            ({"enabled": True, "max_in_window": 5, "window_steps": 4},
             "controls.bad_step.max_in_window", "window of 4 steps"),
            ({"window_steps": 50}, "controls.bad_step.window_steps", "only meaningful"),
            ({"enabled": True, "max_in_window": 2**40}, "controls.bad_step.max_in_window",
             "out of range"),
            ({"enabled": True, "k": 3}, "controls.bad_step.k", "unknown key"),
            ({"enabled": True, "loss_spike_factor": 1.0}, "controls.bad_step.loss_spike_factor",
             "above 1"),
            ({"enabled": True, "loss_spike_factor": 0}, "controls.bad_step.loss_spike_factor",
             "above 1"),
            ({"enabled": True, "loss_spike_factor": "high"},
             "controls.bad_step.loss_spike_factor", "number"),
            ({"enabled": True, "loss_window_steps": 20}, "controls.bad_step.loss_window_steps",
             "loss_spike_factor"),
            ({"loss_spike_factor": 4.0}, "controls.bad_step.loss_spike_factor", "only meaningful"),
            ({"enabled": True, "loss_spike_factor": 4.0, "loss_window_steps": 0},
             "controls.bad_step.loss_window_steps", "must be positive"),
        ],
    )
    @pytest.mark.timeout(10)
    def test_a_bad_policy_names_its_field(self, bad_step, field, said):
        with pytest.raises(InvalidArgument) as e:
            spec_from_dict({**GOOD, "controls": {"bad_step": bad_step}})
        assert e.value.field == field and said in str(e.value)

    @pytest.mark.timeout(10)
    def test_the_policy_is_off_unless_enabled_and_then_pauses_after_three_in_a_hundred(self):
        assert spec_from_dict(GOOD).controls.bad_step == pb.BadStepPolicy()
        bad = spec_from_dict({**GOOD, "controls": {"bad_step": {"enabled": True}}}).controls.bad_step
        assert (bad.enabled, bad.max_in_window, bad.window_steps) == (True, 3, 100)
        bad = spec_from_dict({**GOOD, "controls": {"bad_step": {
            "enabled": True, "max_in_window": 2, "window_steps": 5}}}).controls.bad_step
        assert (bad.max_in_window, bad.window_steps) == (2, 5)
        assert (bad.loss_spike_factor, bad.loss_window_steps) == (0, 0)  # no spike rule
        bad = spec_from_dict({**GOOD, "controls": {"bad_step": {
            "enabled": True, "loss_spike_factor": 4}}}).controls.bad_step
        assert (bad.loss_spike_factor, bad.loss_window_steps) == (4.0, 50)
