import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from springback.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChangeKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHANGE_KIND_UNSPECIFIED: _ClassVar[ChangeKind]
    CHANGE_KIND_START: _ClassVar[ChangeKind]
    CHANGE_KIND_JOIN: _ClassVar[ChangeKind]
    CHANGE_KIND_NODE_LOST: _ClassVar[ChangeKind]
    CHANGE_KIND_RANK_FAILURE: _ClassVar[ChangeKind]
    CHANGE_KIND_DRAIN: _ClassVar[ChangeKind]
    CHANGE_KIND_LEAVE: _ClassVar[ChangeKind]
    CHANGE_KIND_OPERATOR: _ClassVar[ChangeKind]
    CHANGE_KIND_FINISH: _ClassVar[ChangeKind]
    CHANGE_KIND_OTHER: _ClassVar[ChangeKind]
    CHANGE_KIND_CONTROL: _ClassVar[ChangeKind]
    CHANGE_KIND_PREEMPTED: _ClassVar[ChangeKind]
CHANGE_KIND_UNSPECIFIED: ChangeKind
CHANGE_KIND_START: ChangeKind
CHANGE_KIND_JOIN: ChangeKind
CHANGE_KIND_NODE_LOST: ChangeKind
CHANGE_KIND_RANK_FAILURE: ChangeKind
CHANGE_KIND_DRAIN: ChangeKind
CHANGE_KIND_LEAVE: ChangeKind
CHANGE_KIND_OPERATOR: ChangeKind
CHANGE_KIND_FINISH: ChangeKind
CHANGE_KIND_OTHER: ChangeKind
CHANGE_KIND_CONTROL: ChangeKind
CHANGE_KIND_PREEMPTED: ChangeKind

class GenerationEvent(_message.Message):
    __slots__ = ("generation", "created_at", "reason", "kind", "action", "world_size", "members", "restore", "start_step", "steps_redone", "recovery", "first_step_at", "state_lost", "steps_lost", "checkpoint_interval", "started_at", "last_step_at", "startup_s", "rendezvous_s", "transfer_s", "checkpoint_stall_s", "step_s", "spares", "step_p50_s", "step_p90_s", "step_p99_s")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_REDONE_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_AT_FIELD_NUMBER: _ClassVar[int]
    STATE_LOST_FIELD_NUMBER: _ClassVar[int]
    STEPS_LOST_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_AT_FIELD_NUMBER: _ClassVar[int]
    STARTUP_S_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STALL_S_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    SPARES_FIELD_NUMBER: _ClassVar[int]
    STEP_P50_S_FIELD_NUMBER: _ClassVar[int]
    STEP_P90_S_FIELD_NUMBER: _ClassVar[int]
    STEP_P99_S_FIELD_NUMBER: _ClassVar[int]
    generation: int
    created_at: _timestamp_pb2.Timestamp
    reason: str
    kind: ChangeKind
    action: _types_pb2.PlanAction
    world_size: int
    members: _containers.RepeatedScalarFieldContainer[str]
    restore: _types_pb2.RestoreKind
    start_step: int
    steps_redone: int
    recovery: _duration_pb2.Duration
    first_step_at: _timestamp_pb2.Timestamp
    state_lost: str
    steps_lost: int
    checkpoint_interval: _types_pb2.CheckpointInterval
    started_at: _timestamp_pb2.Timestamp
    last_step_at: _timestamp_pb2.Timestamp
    startup_s: float
    rendezvous_s: float
    transfer_s: float
    checkpoint_stall_s: float
    step_s: float
    spares: _containers.RepeatedScalarFieldContainer[str]
    step_p50_s: float
    step_p90_s: float
    step_p99_s: float
    def __init__(self, generation: _Optional[int] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., reason: _Optional[str] = ..., kind: _Optional[_Union[ChangeKind, str]] = ..., action: _Optional[_Union[_types_pb2.PlanAction, str]] = ..., world_size: _Optional[int] = ..., members: _Optional[_Iterable[str]] = ..., restore: _Optional[_Union[_types_pb2.RestoreKind, str]] = ..., start_step: _Optional[int] = ..., steps_redone: _Optional[int] = ..., recovery: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., first_step_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., state_lost: _Optional[str] = ..., steps_lost: _Optional[int] = ..., checkpoint_interval: _Optional[_Union[_types_pb2.CheckpointInterval, _Mapping]] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_step_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., startup_s: _Optional[float] = ..., rendezvous_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., checkpoint_stall_s: _Optional[float] = ..., step_s: _Optional[float] = ..., spares: _Optional[_Iterable[str]] = ..., step_p50_s: _Optional[float] = ..., step_p90_s: _Optional[float] = ..., step_p99_s: _Optional[float] = ...) -> None: ...

class ListJobEventsRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobEventsResponse(_message.Message):
    __slots__ = ("job", "generations")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    job: _types_pb2.Job
    generations: _containers.RepeatedCompositeFieldContainer[GenerationEvent]
    def __init__(self, job: _Optional[_Union[_types_pb2.Job, _Mapping]] = ..., generations: _Optional[_Iterable[_Union[GenerationEvent, _Mapping]]] = ...) -> None: ...

class DeleteJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class DeleteJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: _types_pb2.Job
    def __init__(self, job: _Optional[_Union[_types_pb2.Job, _Mapping]] = ...) -> None: ...

class IssueJoinCredentialRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class IssueJoinCredentialResponse(_message.Message):
    __slots__ = ("credential",)
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    credential: str
    def __init__(self, credential: _Optional[str] = ...) -> None: ...

class CreateJobRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: _types_pb2.JobSpec
    def __init__(self, spec: _Optional[_Union[_types_pb2.JobSpec, _Mapping]] = ...) -> None: ...

class CreateJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: _types_pb2.Job
    def __init__(self, job: _Optional[_Union[_types_pb2.Job, _Mapping]] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GetJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: _types_pb2.Job
    def __init__(self, job: _Optional[_Union[_types_pb2.Job, _Mapping]] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[_types_pb2.Job]
    def __init__(self, jobs: _Optional[_Iterable[_Union[_types_pb2.Job, _Mapping]]] = ...) -> None: ...

class ScaleJobRequest(_message.Message):
    __slots__ = ("job_id", "min_workers", "max_workers")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_WORKERS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    min_workers: int
    max_workers: int
    def __init__(self, job_id: _Optional[str] = ..., min_workers: _Optional[int] = ..., max_workers: _Optional[int] = ...) -> None: ...

class ScaleJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: _types_pb2.Job
    def __init__(self, job: _Optional[_Union[_types_pb2.Job, _Mapping]] = ...) -> None: ...

class PauseJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class PauseJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: _types_pb2.Job
    def __init__(self, job: _Optional[_Union[_types_pb2.Job, _Mapping]] = ...) -> None: ...

class ResumeJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ResumeJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: _types_pb2.Job
    def __init__(self, job: _Optional[_Union[_types_pb2.Job, _Mapping]] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class CancelJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: _types_pb2.Job
    def __init__(self, job: _Optional[_Union[_types_pb2.Job, _Mapping]] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class WatchJobResponse(_message.Message):
    __slots__ = ("job", "event")
    JOB_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    job: _types_pb2.Job
    event: str
    def __init__(self, job: _Optional[_Union[_types_pb2.Job, _Mapping]] = ..., event: _Optional[str] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListCheckpointsResponse(_message.Message):
    __slots__ = ("checkpoints",)
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[_types_pb2.CheckpointRef]
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[_types_pb2.CheckpointRef, _Mapping]]] = ...) -> None: ...

class RestoreJobRequest(_message.Message):
    __slots__ = ("job_id", "step")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class RestoreJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: _types_pb2.Job
    def __init__(self, job: _Optional[_Union[_types_pb2.Job, _Mapping]] = ...) -> None: ...
