"""Job specs: parsing YAML/JSON files and validating `JobSpec` messages.

Every error is an `InvalidArgument` whose field is the dotted path of the bad
key (``data.global_batch_size``), so the CLI, the client and the server give
the same message. Validation has no side effects.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

import yaml
from google.protobuf.message import Message

from springback.client.jobdir import dot_segments
from springback.client.layout import validate as validate_layout
from springback.client.errors import InvalidArgument
from springback.v1 import types_pb2

DEFAULT_MAX_PER_STEP = 3
"""failures.max_per_step when the spec leaves it 0 (see service/policy/failures.py)."""
DEFAULT_WINDOW_S = 600
"""failures.window_s when the spec leaves it 0."""
DEFAULT_PLAN_WAIT_S = 300
"""failures.plan_wait_s when the spec leaves it 0."""
DEFAULT_STORAGE_OUTAGE_S = 1800
"""failures.storage_outage_s when the spec leaves it 0: how long a job waits
for a store that refuses its restore before it ends FAILED naming storage."""
MAX_STORAGE_OUTAGE_S = 7 * 24 * 3600
"""The most failures.storage_outage_s may say (a week)."""
DEFAULT_ON_STATE_LOST = types_pb2.STATE_LOST_POLICY_RESTART
"""failures.on_state_lost when the spec leaves it unset: a state is lost only
when nothing was committed (the steps before the first checkpoint, or a job
with no checkpoint.uri), which is what a restart from step 0 costs anyway;
the loss is an event, a counter and the job's message, never quiet."""
DEFAULT_KEEP_LAST = 3
"""checkpoint.keep_last when a spec file's checkpoint section has no such key.
An explicit 0 (and 0 in a `JobSpec` message, where absent and 0 are one) keeps
every checkpoint: the rule is `service.commits.retained`'s, the only one."""

DEFAULT_STOP_WINDOW_S = 300
"""controls.stop.window_s when a windowed stop rule (goodput floor, cost
ceiling) is set and the window is not: five minutes, long enough that one
recovery of a healthy job (seconds to a minute) does not cross a floor by
itself (docs/controls.md)."""

DEFAULT_BAD_STEP_MAX_IN_WINDOW = 3
"""controls.bad_step.max_in_window when the policy is enabled and the key is
left out: three skipped steps in the window pause the job."""

DEFAULT_BAD_STEP_WINDOW_STEPS = 100
"""controls.bad_step.window_steps when the policy is enabled and the key is
left out."""

DEFAULT_BAD_STEP_LOSS_WINDOW_STEPS = 50
"""controls.bad_step.loss_window_steps when the spike rule is on and the key
is left out: the median of a rank's last 50 applied steps' losses."""

DEFAULT_STRAGGLER_FACTOR = 1.5
"""controls.straggler.factor when the policy is enabled and the key is left
out: a member computing 1.5 x the median of the others is a straggler."""

DEFAULT_STRAGGLER_WINDOW_STEPS = 30
"""controls.straggler.window_steps when the policy is enabled and the key is
left out."""

DEFAULT_STRAGGLER_COOLDOWN_S = 600
"""controls.straggler.cooldown_s when the policy is enabled and the key is
left out: a member set aside may train again ten minutes later."""

DEFAULT_PEER_COPY_EVERY_STEPS = 10
"""peer_copies.every_steps (K) when the spec has none. A copy costs one host
memory copy of the rank's shards plus their transfer to another node, both
overlapped with the next steps, so its share of a step falls as 1/K; a lost
node costs at most K steps redone. At 10 the copy's cost stays a few percent
of a step even where a step is no longer than the transfer, and the redone
work is seconds for step times under a second (docs/worker.md, "Peer copies")."""


def peer_copy_every_steps(spec: types_pb2.JobSpec) -> int:
    """K of `spec` (0: no peer copies); the default when the field is absent."""
    if spec.peer_copies.HasField("every_steps"):
        return int(spec.peer_copies.every_steps)
    return DEFAULT_PEER_COPY_EVERY_STEPS


_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_URI_SCHEMES = ("file://", "s3://", "memory://", "/")

_INT_OR_AUTO = "int or auto"
"""checkpoint.every_steps: a step count, or ``auto`` (`service.ckptinterval`)."""

# key -> (kind, required); kind is int, float, str, _INT_OR_AUTO, a tuple of
# allowed strings or a nested schema.
_SCHEMA: dict[str, Any] = {
    "name": (str, True),
    "min_workers": (int, False),
    "max_workers": (int, False),
    "layout": ({"tp": (int, False), "pp": (int, False), "ep": (int, False),
                "shard": (int, False), "min_pp": (int, False)}, False),
    "data": (
        {"num_samples": (int, True), "global_batch_size": (int, True), "seed": (int, False)},
        True,
    ),
    "checkpoint": (
        {
            "uri": (str, True),
            "every_steps": (_INT_OR_AUTO, False),
            "keep_last": (int, False),
            "keep_every": (int, False),
            "min_every_steps": (int, False),
            "max_every_steps": (int, False),
            "mtbf_prior_s": (int, False),
        },
        False,
    ),
    "max_steps": (int, True),
    "failures": (
        {"max_per_step": (int, False), "window_s": (int, False), "plan_wait_s": (int, False),
         "on_state_lost": (("restart", "fail"), False), "storage_outage_s": (int, False)},
        False,
    ),
    "peer_copies": ({"every_steps": (int, False)}, False),
    "price_per_node_hour": (float, False),
    "controls": (
        {"stop": ({"goodput_floor": (float, False), "window_s": (int, False),
                   "cost_per_step_ceiling": (float, False), "no_progress_s": (int, False),
                   "action": (("pause", "fail"), False)}, False),
         "bad_step": ({"enabled": (bool, False), "max_in_window": (int, False),
                       "window_steps": (int, False), "loss_spike_factor": (float, False),
                       "loss_window_steps": (int, False)}, False),
         "straggler": ({"enabled": (bool, False), "factor": (float, False),
                        "window_steps": (int, False), "cooldown_s": (int, False),
                        "change_cost_s": (float, False), "horizon_steps": (int, False)},
                       False)},
        False,
    ),
}


def _check(value: Mapping[str, Any], schema: dict[str, Any], path: str) -> None:
    if not isinstance(value, Mapping):
        raise InvalidArgument(path or "spec", "must be a mapping")
    for key in value:
        if key not in schema:
            where = f"{path}.{key}" if path else str(key)
            raise InvalidArgument(where, f"unknown key (expected one of {', '.join(schema)})")
    for key, (kind, required) in schema.items():
        where = f"{path}.{key}" if path else key
        if key not in value or value[key] is None:
            if required:
                raise InvalidArgument(where, "is required")
            continue
        item = value[key]
        if kind == _INT_OR_AUTO:
            if item == "auto":
                continue
            if isinstance(item, bool) or not isinstance(item, int):
                raise InvalidArgument(where, f"must be an integer or auto, got {item!r}")
            kind = int
        if isinstance(kind, dict):
            _check(item, kind, where)
        elif kind is int and (isinstance(item, bool) or not isinstance(item, int)):
            raise InvalidArgument(where, f"must be an integer, got {item!r}")
        elif kind is int and item < 0:
            raise InvalidArgument(where, f"must not be negative, got {item}")
        elif kind is float and (isinstance(item, bool) or not isinstance(item, (int, float))):
            raise InvalidArgument(where, f"must be a number, got {item!r}")
        elif kind is float and not item >= 0:
            raise InvalidArgument(where, f"must not be negative, got {item}")
        elif kind is bool and not isinstance(item, bool):
            raise InvalidArgument(where, f"must be true or false, got {item!r}")
        elif kind is str and not isinstance(item, str):
            raise InvalidArgument(where, f"must be a string, got {item!r}")
        elif isinstance(kind, tuple) and item not in kind:
            raise InvalidArgument(where, f"must be one of {', '.join(kind)}, got {item!r}")


def spec_from_dict(value: Mapping[str, Any]) -> types_pb2.JobSpec:
    """A validated `JobSpec` from a parsed YAML/JSON mapping."""
    _check(value, _SCHEMA, "")
    spec = types_pb2.JobSpec()
    if value.get("checkpoint") and value["checkpoint"].get("keep_last") is None:
        spec.checkpoint.keep_last = DEFAULT_KEEP_LAST
    fields: list[tuple[Message, str, str]] = [(spec, key, key) for key in ("name", "min_workers", "max_workers", "max_steps",
                                           "price_per_node_hour")]
    fields += [
        (getattr(spec, section), key, f"{section}.{key}")
        for section in ("layout", "data", "checkpoint", "failures", "peer_copies")
        for key in (value.get(section) or {})
    ]
    message: Message
    for message, key, where in fields:
        section, _, _ = where.rpartition(".")
        item = (value.get(section) or {}).get(key) if section else value.get(key)
        if item is None:
            continue
        if where == "checkpoint.every_steps" and item == "auto":
            spec.checkpoint.auto_interval = True
            continue
        if where == "failures.on_state_lost":
            item = types_pb2.StateLostPolicy.Value(f"STATE_LOST_POLICY_{item.upper()}")
        try:
            setattr(message, key, item)
        except (ValueError, TypeError) as e:  # out of the field's integer range
            raise InvalidArgument(where, f"{item!r} is out of range ({e})") from e
    _stop_rules_from_dict((value.get("controls") or {}).get("stop") or {}, spec.controls.stop)
    _bad_step_from_dict((value.get("controls") or {}).get("bad_step") or {},
                        spec.controls.bad_step)
    _straggler_from_dict((value.get("controls") or {}).get("straggler") or {},
                         spec.controls.straggler)
    return validate(spec)


def _straggler_from_dict(value: Mapping[str, Any], out: types_pb2.StragglerPolicy) -> None:
    """``controls.straggler`` of a spec file (type-checked by `_check`) into
    `out`; an explicit 0 is refused (leave the key out for the default)."""
    out.enabled = bool(value.get("enabled", False))
    for key in ("factor", "window_steps", "cooldown_s", "change_cost_s", "horizon_steps"):
        item = value.get(key)
        if item is None:
            continue
        if item == 0:
            raise InvalidArgument(f"controls.straggler.{key}",
                                  "must be positive (leave it out for the default)")
        try:
            setattr(out, key, item)
        except (ValueError, TypeError) as e:  # out of the field's integer range
            raise InvalidArgument(f"controls.straggler.{key}",
                                  f"{item!r} is out of range ({e})") from e


def _bad_step_from_dict(value: Mapping[str, Any], out: types_pb2.BadStepPolicy) -> None:
    """``controls.bad_step`` of a spec file (type-checked by `_check`) into
    `out`; an explicit 0 is refused (leave the key out for the default)."""
    out.enabled = bool(value.get("enabled", False))
    factor = value.get("loss_spike_factor")
    if factor is not None:
        if factor == 0:
            raise InvalidArgument("controls.bad_step.loss_spike_factor",
                                  "must be above 1 (leave it out for no spike rule)")
        out.loss_spike_factor = factor
    for key in ("max_in_window", "window_steps", "loss_window_steps"):
        item = value.get(key)
        if item is None:
            continue
        if item == 0:
            raise InvalidArgument(f"controls.bad_step.{key}",
                                  "must be positive (leave it out for the default)")
        try:
            setattr(out, key, item)
        except (ValueError, TypeError) as e:  # out of the field's integer range
            raise InvalidArgument(f"controls.bad_step.{key}",
                                  f"{item!r} is out of range ({e})") from e


def _stop_rules_from_dict(value: Mapping[str, Any], out: types_pb2.StopRules) -> None:
    """``controls.stop`` of a spec file (already type-checked by `_check`)
    into `out`. An explicit 0 is refused here (in a message 0 is "off" or
    "default", which a file says by leaving the key out)."""
    for key in ("goodput_floor", "window_s", "cost_per_step_ceiling", "no_progress_s"):
        item = value.get(key)
        if item is None:
            continue
        if item == 0:
            left_out = (f"for the default, {DEFAULT_STOP_WINDOW_S} s" if key == "window_s"
                        else "to turn the rule off")
            raise InvalidArgument(f"controls.stop.{key}",
                                  f"must be positive (leave it out {left_out})")
        try:
            setattr(out, key, item)
        except (ValueError, TypeError) as e:  # out of the field's integer range
            raise InvalidArgument(f"controls.stop.{key}", f"{item!r} is out of range ({e})") from e
    if value.get("action") is not None:
        out.action = (types_pb2.STOP_ACTION_FAIL if value["action"] == "fail"
                      else types_pb2.STOP_ACTION_PAUSE)


def load_spec_file(path: str) -> types_pb2.JobSpec:
    """Reads and validates a spec file (YAML, or JSON by extension)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise InvalidArgument(path, f"cannot read: {e.strerror}") from e
    try:
        value = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise InvalidArgument(path, f"not valid {'JSON' if path.endswith('.json') else 'YAML'}: {e}") from e
    try:
        return spec_from_dict(value)
    except InvalidArgument as e:
        raise InvalidArgument(e.field, f"{e.problem} (in {path})") from e


def validate(spec: types_pb2.JobSpec) -> types_pb2.JobSpec:
    """A copy of `spec` with defaults filled in; raises on the first bad field.

    Defaults: min_workers 1, max_workers = min_workers, the layout's as
    `client.layout.validate` fills them in (degrees 1, min_pp = pp),
    failures as in `service.failures` (3 per step in 600 s, plans awaited
    300 s, a lost state restarts from step 0: `DEFAULT_ON_STATE_LOST`),
    peer_copies.every_steps `DEFAULT_PEER_COPY_EVERY_STEPS` (0 disables
    the copies), (checkpoint.keep_last 0 keeps every checkpoint; spec files
    default it to `DEFAULT_KEEP_LAST`).
    """
    out = types_pb2.JobSpec()
    out.CopyFrom(spec)
    if not _NAME.match(out.name):
        raise InvalidArgument(
            "name", f"{out.name!r} must be 1-63 lowercase letters, digits or '-', "
            "starting and ending with a letter or digit"
        )
    out.min_workers = out.min_workers or 1
    out.max_workers = out.max_workers or out.min_workers
    if out.max_workers < out.min_workers:
        raise InvalidArgument(
            "max_workers", f"{out.max_workers} is below min_workers {out.min_workers}"
        )
    validate_layout(out.layout)
    out.failures.max_per_step = out.failures.max_per_step or DEFAULT_MAX_PER_STEP
    out.failures.window_s = out.failures.window_s or DEFAULT_WINDOW_S
    out.failures.plan_wait_s = out.failures.plan_wait_s or DEFAULT_PLAN_WAIT_S
    out.failures.on_state_lost = out.failures.on_state_lost or DEFAULT_ON_STATE_LOST
    out.failures.storage_outage_s = out.failures.storage_outage_s or DEFAULT_STORAGE_OUTAGE_S
    if out.failures.storage_outage_s > MAX_STORAGE_OUTAGE_S:
        raise InvalidArgument("failures.storage_outage_s", f"{out.failures.storage_outage_s} is "
                              f"above {MAX_STORAGE_OUTAGE_S} (a week)")
    out.peer_copies.every_steps = peer_copy_every_steps(out)
    if out.data.num_samples == 0:
        raise InvalidArgument("data.num_samples", "must be positive")
    if out.data.global_batch_size == 0:
        raise InvalidArgument("data.global_batch_size", "must be positive")
    if out.data.global_batch_size > out.data.num_samples:
        raise InvalidArgument(
            "data.global_batch_size",
            f"{out.data.global_batch_size} exceeds data.num_samples {out.data.num_samples}",
        )
    if out.max_steps == 0:
        raise InvalidArgument("max_steps", "must be positive")
    if out.checkpoint.uri:
        if not out.checkpoint.uri.startswith(_URI_SCHEMES):
            raise InvalidArgument(
                "checkpoint.uri",
                f"{out.checkpoint.uri!r} must be an absolute path or a file://, s3:// "
                "or memory:// URI",
            )
        if dot_segments(out.checkpoint.uri):
            raise InvalidArgument("checkpoint.uri", f"{out.checkpoint.uri!r} has a '.' or '..' "
                                  "segment (give the directory itself)")
    elif out.checkpoint.every_steps or out.checkpoint.auto_interval:
        raise InvalidArgument("checkpoint.uri", "is required when checkpoint.every_steps is set")
    _validate_auto_interval(out)
    if not out.price_per_node_hour >= 0 or math.isinf(out.price_per_node_hour):
        raise InvalidArgument("price_per_node_hour",
                              f"must be a finite number >= 0, got {out.price_per_node_hour}")
    _validate_stop_rules(out)
    _validate_bad_step(out)
    _validate_straggler(out)
    return out


def _validate_straggler(out: types_pb2.JobSpec) -> None:
    """``controls.straggler`` (`service.stragglers`): off unless enabled;
    enabled, the factor, window and cool-down take their defaults."""
    policy = out.controls.straggler
    if not policy.enabled:
        for key in ("factor", "window_steps", "cooldown_s", "change_cost_s", "horizon_steps"):
            if getattr(policy, key):
                raise InvalidArgument(f"controls.straggler.{key}",
                                      "is only meaningful with controls.straggler.enabled: true")
        return
    policy.factor = policy.factor or DEFAULT_STRAGGLER_FACTOR
    if not math.isfinite(policy.factor) or policy.factor <= 1:
        raise InvalidArgument("controls.straggler.factor",
                              f"must be a finite number above 1 (1.5: 50 % slower than the "
                              f"median of the others), got {policy.factor}")
    if not math.isfinite(policy.change_cost_s) or policy.change_cost_s < 0:
        raise InvalidArgument("controls.straggler.change_cost_s",
                              f"must be a finite number of seconds above 0 (leave it out to "
                              f"measure it), got {policy.change_cost_s}")
    policy.window_steps = policy.window_steps or DEFAULT_STRAGGLER_WINDOW_STEPS
    policy.cooldown_s = policy.cooldown_s or DEFAULT_STRAGGLER_COOLDOWN_S


def _validate_bad_step(out: types_pb2.JobSpec) -> None:
    """``controls.bad_step`` (`worker.train.badstep`): off unless enabled;
    enabled, the window and the limit take their defaults, and the limit
    must fit in the window."""
    bad = out.controls.bad_step
    if not bad.enabled:
        for key in ("max_in_window", "window_steps", "loss_spike_factor", "loss_window_steps"):
            if getattr(bad, key):
                raise InvalidArgument(f"controls.bad_step.{key}",
                                      "is only meaningful with controls.bad_step.enabled: true")
        return
    bad.max_in_window = bad.max_in_window or DEFAULT_BAD_STEP_MAX_IN_WINDOW
    bad.window_steps = bad.window_steps or DEFAULT_BAD_STEP_WINDOW_STEPS
    if bad.loss_spike_factor:
        if not math.isfinite(bad.loss_spike_factor) or bad.loss_spike_factor <= 1:
            raise InvalidArgument("controls.bad_step.loss_spike_factor",
                                  f"must be a finite number above 1 (leave it out for no spike "
                                  f"rule), got {bad.loss_spike_factor}")
        bad.loss_window_steps = bad.loss_window_steps or DEFAULT_BAD_STEP_LOSS_WINDOW_STEPS
    elif bad.loss_window_steps:
        raise InvalidArgument("controls.bad_step.loss_window_steps",
                              "is only meaningful with controls.bad_step.loss_spike_factor")
    if bad.max_in_window > bad.window_steps:
        raise InvalidArgument("controls.bad_step.max_in_window",
                              f"{bad.max_in_window} bad steps can never fall in a window of "
                              f"{bad.window_steps} steps (controls.bad_step.window_steps)")


def _validate_stop_rules(out: types_pb2.JobSpec) -> None:
    """``controls.stop`` (`service.stoprules`): every rule off by default;
    with a windowed rule on, the window defaults to `DEFAULT_STOP_WINDOW_S`;
    with any rule on, the action defaults to pause."""
    stop = out.controls.stop
    floor, ceiling = stop.goodput_floor, stop.cost_per_step_ceiling
    if not 0 <= floor <= 1:
        raise InvalidArgument("controls.stop.goodput_floor",
                              f"must be a share above 0 and at most 1 (80 % is 0.8), got {floor}")
    if not ceiling >= 0 or math.isinf(ceiling):
        raise InvalidArgument("controls.stop.cost_per_step_ceiling",
                              f"must be a finite number > 0, got {ceiling}")
    if ceiling and not out.price_per_node_hour:
        raise InvalidArgument("controls.stop.cost_per_step_ceiling",
                              "needs price_per_node_hour (the job has no cost figure without it)")
    if floor or ceiling:
        stop.window_s = stop.window_s or DEFAULT_STOP_WINDOW_S
    elif stop.window_s:
        raise InvalidArgument("controls.stop.window_s", "is only meaningful with "
                              "controls.stop.goodput_floor or cost_per_step_ceiling")
    if (floor or ceiling or stop.no_progress_s) and not stop.action:
        stop.action = types_pb2.STOP_ACTION_PAUSE


def _validate_auto_interval(out: types_pb2.JobSpec) -> None:
    """The bounds of `checkpoint.every_steps: auto` (`service.ckptinterval`)."""
    ck = out.checkpoint
    if not ck.auto_interval:
        for name in ("min_every_steps", "max_every_steps", "mtbf_prior_s"):
            if getattr(ck, name):
                raise InvalidArgument(f"checkpoint.{name}",
                                      "is only meaningful with checkpoint.every_steps: auto")
        return
    if ck.min_every_steps and ck.max_every_steps and ck.min_every_steps > ck.max_every_steps:
        raise InvalidArgument("checkpoint.min_every_steps",
                              f"{ck.min_every_steps} exceeds checkpoint.max_every_steps "
                              f"{ck.max_every_steps}")
