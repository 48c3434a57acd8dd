"""The JSON views of API objects, shared by the CLI (`--json`) and the dashboard.

Pure functions of `springback.v1` messages: no I/O, nothing raised for a
well-formed message.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.timestamp_pb2 import Timestamp

from springback.v1 import job_service_pb2 as js
from springback.v1 import types_pb2 as pb


def job_summary(job: pb.Job) -> dict[str, Any]:
    """The `job get --json` object."""
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
        "spec": MessageToDict(job.spec, preserving_proto_field_name=True),
    }


def _time(ts: Timestamp) -> str | None:
    return ts.ToJsonString() if ts.seconds or ts.nanos else None


def _enum(name: str, prefix: str) -> str:
    return name.removeprefix(prefix).lower()


def event_summary(event: js.GenerationEvent) -> dict[str, Any]:
    """One generation of `job events --json`."""
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
    }


def history_summary(job: pb.Job, events: list[js.GenerationEvent]) -> dict[str, Any]:
    """The `job events --json` object."""
    return {
        "id": job.id, "name": job.spec.name,
        "state": _enum(pb.JobState.Name(job.status.state), "JOB_STATE_"),
        "created_at": _time(job.created_at), "started_at": _time(job.started_at),
        "finished_at": _time(job.finished_at), "step": job.status.step,
        "message": job.status.message,
        "generations": [event_summary(e) for e in events],
    }
