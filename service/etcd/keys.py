"""The etcd key schema (version 1). Documented in docs/etcd-schema.md.

Every key lives under ``/springback/v1/``; values are serialized protobuf
messages of ``springback.v1`` (never JSON), except the leader record, which is
the leader's advertised ``HOST:PORT`` as UTF-8.
"""

from __future__ import annotations

PREFIX = "/springback/v1/"

LEADER = PREFIX + "leader"
"""Leader record, bound to the leader's lease; its create revision fences writes."""

JOBS = PREFIX + "jobs/"
PLANS = PREFIX + "plans/"
MEMBERS = PREFIX + "members/"
CHECKPOINTS = PREFIX + "checkpoints/"
HISTORY = PREFIX + "history/"


def job(job_id: str) -> str:
    """A `Job` (spec + persisted status)."""
    return JOBS + job_id


def plan(job_id: str) -> str:
    """The current `Plan` of a job; its generation only ever grows."""
    return PLANS + job_id


def members(job_id: str) -> str:
    """Prefix of a job's `Member` records."""
    return f"{MEMBERS}{job_id}/"


def member(job_id: str, member_id: str) -> str:
    """A `Member`, bound to the member's own lease (deleted when it expires)."""
    return f"{MEMBERS}{job_id}/{member_id}"


def checkpoints(job_id: str) -> str:
    """Prefix of a job's committed `CheckpointRef`s."""
    return f"{CHECKPOINTS}{job_id}/"


def checkpoint(job_id: str, step: int) -> str:
    """A committed `CheckpointRef`; zero-padded so keys sort by step."""
    return f"{CHECKPOINTS}{job_id}/{step:020d}"


def history(job_id: str) -> str:
    """Prefix of a job's `GenerationEvent`s (its history, `service/core/history.py`)."""
    return f"{HISTORY}{job_id}/"


def history_event(job_id: str, generation: int) -> str:
    """The `GenerationEvent` of one generation; zero-padded so keys sort by generation."""
    return f"{HISTORY}{job_id}/{generation:012d}"


def member_job_and_id(key: str) -> tuple[str, str]:
    """(job_id, member_id) of a member key."""
    job_id, _, member_id = key[len(MEMBERS):].partition("/")
    return job_id, member_id
