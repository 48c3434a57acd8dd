"""The JSON views of API objects, shared by the CLI (`--json`) and the dashboard.

Pure functions of `springback.v1` messages: no I/O, nothing raised for a
well-formed message.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.timestamp_pb2 import Timestamp

from springback.client import badput
from springback.v1 import job_service_pb2 as js
from springback.v1 import types_pb2 as pb


def job_summary(job: pb.Job, events: Sequence[js.GenerationEvent] | None = None,
                now: float | None = None) -> dict[str, Any]:
    """The `job get --json` object; with the job's `events`, its badput by
    cause (`badput.job_badput`, until `now`, default the clock) too."""
    status = job.status
    checkpoint = None
    if status.last_checkpoint.step:
        checkpoint = {
            "step": status.last_checkpoint.step, "uri": status.last_checkpoint.uri,
            "generation": status.last_checkpoint.generation,
            "world_size": status.last_checkpoint.world_size,
        }
    return {
        "id": job.id,
        "name": job.spec.name,
        "state": pb.JobState.Name(status.state).removeprefix("JOB_STATE_").lower(),
        "generation": status.generation,
        "world_size": status.world_size,
        "members": list(status.members),
        "spares": list(status.spares),
        "step": status.step,
        "max_steps": job.spec.max_steps,
        "samples_consumed": status.samples_consumed,
        "loss": status.loss,
        "last_checkpoint": checkpoint,
        "checkpoint_error": status.checkpoint_error or None,
        "restores": status.num_restores,
        "steps_redone": status.steps_redone,
        "state_losses": status.num_state_losses,
        "steps_lost": status.steps_lost,
        "failures": status.num_failures,
        "message": status.message,
        "member_timing": [{"member": t.member_id, "compute_p50_s": t.compute_p50_s,
                           "collective_p50_s": t.collective_p50_s, "steps": t.num_steps}
                          for t in status.member_timing],
        "spec": MessageToDict(job.spec, preserving_proto_field_name=True),
        **(_badput(job, events, now) if events is not None else {}),
    }


def _badput(job: pb.Job, events: Sequence[js.GenerationEvent],
            now: float | None) -> dict[str, Any]:
    total = badput.job_badput(job, events, time.time() if now is None else now)
    return {"badput": {"wall_s": total["wall_s"], "useful_ratio": total["useful_ratio"],
                       "causes_s": total["causes"]},
            "cost": total["cost"]}


def _time(ts: Timestamp) -> str | None:
    return ts.ToJsonString() if ts.seconds or ts.nanos else None


def _enum(name: str, prefix: str) -> str:
    return name.removeprefix(prefix).lower()


def event_summary(event: js.GenerationEvent,
                  causes: tuple[float, dict[str, float]] | None = None) -> dict[str, Any]:
    """One generation of `job events --json`; `causes`: its wall seconds and
    badput by cause."""
    interval = event.checkpoint_interval if event.HasField("checkpoint_interval") else None
    return {
        "generation": event.generation,
        "time": _time(event.created_at),
        "kind": _enum(js.ChangeKind.Name(event.kind), "CHANGE_KIND_"),
        "reason": event.reason,
        "action": _enum(pb.PlanAction.Name(event.action), "PLAN_ACTION_"),
        "world_size": event.world_size,
        "members": list(event.members),
        "restore": _enum(pb.RestoreKind.Name(event.restore), "RESTORE_KIND_"),
        "start_step": event.start_step,
        "steps_redone": event.steps_redone,
        "steps_lost": event.steps_lost,
        "state_lost": event.state_lost or None,
        "recovery_s": event.recovery.ToNanoseconds() / 1e9 if event.HasField("recovery") else None,
        "first_step_at": _time(event.first_step_at),
        "step_time_s": ({"p50": event.step_p50_s, "p90": event.step_p90_s,
                         "p99": event.step_p99_s} if event.step_p50_s else None),
        "checkpoint_interval": None if interval is None else MessageToDict(
            interval, preserving_proto_field_name=True, always_print_fields_with_no_presence=True),
        **({"wall_s": causes[0], "badput_s": causes[1]} if causes is not None else {}),
    }


def history_summary(job: pb.Job, events: list[js.GenerationEvent],
                    now: float | None = None) -> dict[str, Any]:
    """The `job events --json` object (badput until `now`, default the clock)."""
    now = time.time() if now is None else now
    rows = badput.per_generation(job, events, now)
    return {
        "id": job.id, "name": job.spec.name,
        "state": _enum(pb.JobState.Name(job.status.state), "JOB_STATE_"),
        "created_at": _time(job.created_at), "started_at": _time(job.started_at),
        "finished_at": _time(job.finished_at), "step": job.status.step,
        "message": job.status.message,
        "generations": [event_summary(e, (w, c)) for e, w, c in rows],
        **_badput(job, events, now),
    }
