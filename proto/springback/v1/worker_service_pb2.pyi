import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from springback.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JoinJobRequest(_message.Message):
    __slots__ = ("job_id", "host", "rendezvous_port", "num_local_ranks", "join_token")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_PORT_FIELD_NUMBER: _ClassVar[int]
    NUM_LOCAL_RANKS_FIELD_NUMBER: _ClassVar[int]
    JOIN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    host: str
    rendezvous_port: int
    num_local_ranks: int
    join_token: str
    def __init__(self, job_id: _Optional[str] = ..., host: _Optional[str] = ..., rendezvous_port: _Optional[int] = ..., num_local_ranks: _Optional[int] = ..., join_token: _Optional[str] = ...) -> None: ...

class JoinJobResponse(_message.Message):
    __slots__ = ("member", "liveness_timeout", "heartbeat_interval", "member_credential")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    LIVENESS_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    MEMBER_CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    member: _types_pb2.Member
    liveness_timeout: _duration_pb2.Duration
    heartbeat_interval: _duration_pb2.Duration
    member_credential: str
    def __init__(self, member: _Optional[_Union[_types_pb2.Member, _Mapping]] = ..., liveness_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., heartbeat_interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., member_credential: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("job_id", "member_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    member_id: str
    def __init__(self, job_id: _Optional[str] = ..., member_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("generation", "heartbeat_interval")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    generation: int
    heartbeat_interval: _duration_pb2.Duration
    def __init__(self, generation: _Optional[int] = ..., heartbeat_interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class LeaveJobRequest(_message.Message):
    __slots__ = ("job_id", "member_id", "reason", "preempted")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    member_id: str
    reason: str
    preempted: bool
    def __init__(self, job_id: _Optional[str] = ..., member_id: _Optional[str] = ..., reason: _Optional[str] = ..., preempted: _Optional[bool] = ...) -> None: ...

class LeaveJobResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainMemberRequest(_message.Message):
    __slots__ = ("job_id", "member_id", "reason", "preempted")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    member_id: str
    reason: str
    preempted: bool
    def __init__(self, job_id: _Optional[str] = ..., member_id: _Optional[str] = ..., reason: _Optional[str] = ..., preempted: _Optional[bool] = ...) -> None: ...

class DrainMemberResponse(_message.Message):
    __slots__ = ("checkpoint",)
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    checkpoint: bool
    def __init__(self, checkpoint: _Optional[bool] = ...) -> None: ...

class WatchPlansRequest(_message.Message):
    __slots__ = ("job_id", "member_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    member_id: str
    def __init__(self, job_id: _Optional[str] = ..., member_id: _Optional[str] = ...) -> None: ...

class WatchPlansResponse(_message.Message):
    __slots__ = ("plan",)
    PLAN_FIELD_NUMBER: _ClassVar[int]
    plan: _types_pb2.Plan
    def __init__(self, plan: _Optional[_Union[_types_pb2.Plan, _Mapping]] = ...) -> None: ...

class ReportStepRequest(_message.Message):
    __slots__ = ("job_id", "member_id", "generation", "step", "samples_consumed", "loss", "cursor", "generation_start", "restored_from", "state_lost", "checkpoint_stall_s", "startup_s", "rendezvous_s", "transfer_s", "checkpoint_stall_total_s", "step_p50_s", "step_p90_s", "step_p99_s", "member_timing", "store_intrusion")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_CONSUMED_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    GENERATION_START_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FROM_FIELD_NUMBER: _ClassVar[int]
    STATE_LOST_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STALL_S_FIELD_NUMBER: _ClassVar[int]
    STARTUP_S_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STALL_TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    STEP_P50_S_FIELD_NUMBER: _ClassVar[int]
    STEP_P90_S_FIELD_NUMBER: _ClassVar[int]
    STEP_P99_S_FIELD_NUMBER: _ClassVar[int]
    MEMBER_TIMING_FIELD_NUMBER: _ClassVar[int]
    STORE_INTRUSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    member_id: str
    generation: int
    step: int
    samples_consumed: int
    loss: float
    cursor: _types_pb2.DataCursor
    generation_start: bool
    restored_from: _types_pb2.RestoreKind
    state_lost: str
    checkpoint_stall_s: float
    startup_s: float
    rendezvous_s: float
    transfer_s: float
    checkpoint_stall_total_s: float
    step_p50_s: float
    step_p90_s: float
    step_p99_s: float
    member_timing: _containers.RepeatedCompositeFieldContainer[_types_pb2.MemberTiming]
    store_intrusion: str
    def __init__(self, job_id: _Optional[str] = ..., member_id: _Optional[str] = ..., generation: _Optional[int] = ..., step: _Optional[int] = ..., samples_consumed: _Optional[int] = ..., loss: _Optional[float] = ..., cursor: _Optional[_Union[_types_pb2.DataCursor, _Mapping]] = ..., generation_start: _Optional[bool] = ..., restored_from: _Optional[_Union[_types_pb2.RestoreKind, str]] = ..., state_lost: _Optional[str] = ..., checkpoint_stall_s: _Optional[float] = ..., startup_s: _Optional[float] = ..., rendezvous_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., checkpoint_stall_total_s: _Optional[float] = ..., step_p50_s: _Optional[float] = ..., step_p90_s: _Optional[float] = ..., step_p99_s: _Optional[float] = ..., member_timing: _Optional[_Iterable[_Union[_types_pb2.MemberTiming, _Mapping]]] = ..., store_intrusion: _Optional[str] = ...) -> None: ...

class ReportStepResponse(_message.Message):
    __slots__ = ("generation",)
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    generation: int
    def __init__(self, generation: _Optional[int] = ...) -> None: ...

class ReportFailureRequest(_message.Message):
    __slots__ = ("job_id", "member_id", "generation", "reason", "state_kept", "lost_peer", "lost_rank", "job_fatal", "storage_unavailable", "job_pause")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STATE_KEPT_FIELD_NUMBER: _ClassVar[int]
    LOST_PEER_FIELD_NUMBER: _ClassVar[int]
    LOST_RANK_FIELD_NUMBER: _ClassVar[int]
    JOB_FATAL_FIELD_NUMBER: _ClassVar[int]
    STORAGE_UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    JOB_PAUSE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    member_id: str
    generation: int
    reason: str
    state_kept: bool
    lost_peer: bool
    lost_rank: int
    job_fatal: bool
    storage_unavailable: bool
    job_pause: bool
    def __init__(self, job_id: _Optional[str] = ..., member_id: _Optional[str] = ..., generation: _Optional[int] = ..., reason: _Optional[str] = ..., state_kept: _Optional[bool] = ..., lost_peer: _Optional[bool] = ..., lost_rank: _Optional[int] = ..., job_fatal: _Optional[bool] = ..., storage_unavailable: _Optional[bool] = ..., job_pause: _Optional[bool] = ...) -> None: ...

class ReportFailureResponse(_message.Message):
    __slots__ = ("generation",)
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    generation: int
    def __init__(self, generation: _Optional[int] = ...) -> None: ...

class CommitCheckpointRequest(_message.Message):
    __slots__ = ("job_id", "member_id", "generation", "checkpoint")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    member_id: str
    generation: int
    checkpoint: _types_pb2.CheckpointRef
    def __init__(self, job_id: _Optional[str] = ..., member_id: _Optional[str] = ..., generation: _Optional[int] = ..., checkpoint: _Optional[_Union[_types_pb2.CheckpointRef, _Mapping]] = ...) -> None: ...

class CommitCheckpointResponse(_message.Message):
    __slots__ = ("retained",)
    RETAINED_FIELD_NUMBER: _ClassVar[int]
    retained: _containers.RepeatedCompositeFieldContainer[_types_pb2.CheckpointRef]
    def __init__(self, retained: _Optional[_Iterable[_Union[_types_pb2.CheckpointRef, _Mapping]]] = ...) -> None: ...

class ReportCheckpointErrorRequest(_message.Message):
    __slots__ = ("job_id", "member_id", "generation", "error")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    member_id: str
    generation: int
    error: str
    def __init__(self, job_id: _Optional[str] = ..., member_id: _Optional[str] = ..., generation: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class ReportCheckpointErrorResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PlanStreamNote(_message.Message):
    __slots__ = ("job_id", "member_id", "stream_id", "opened", "by_client")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    OPENED_FIELD_NUMBER: _ClassVar[int]
    BY_CLIENT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    member_id: str
    stream_id: str
    opened: bool
    by_client: bool
    def __init__(self, job_id: _Optional[str] = ..., member_id: _Optional[str] = ..., stream_id: _Optional[str] = ..., opened: _Optional[bool] = ..., by_client: _Optional[bool] = ...) -> None: ...

class ReportPlanStreamsRequest(_message.Message):
    __slots__ = ("replica", "notes")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    replica: str
    notes: _containers.RepeatedCompositeFieldContainer[PlanStreamNote]
    def __init__(self, replica: _Optional[str] = ..., notes: _Optional[_Iterable[_Union[PlanStreamNote, _Mapping]]] = ...) -> None: ...

class ReportPlanStreamsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
