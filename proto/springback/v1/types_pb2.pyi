import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StateLostPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATE_LOST_POLICY_UNSPECIFIED: _ClassVar[StateLostPolicy]
    STATE_LOST_POLICY_RESTART: _ClassVar[StateLostPolicy]
    STATE_LOST_POLICY_FAIL: _ClassVar[StateLostPolicy]

class StopAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STOP_ACTION_UNSPECIFIED: _ClassVar[StopAction]
    STOP_ACTION_PAUSE: _ClassVar[StopAction]
    STOP_ACTION_FAIL: _ClassVar[StopAction]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_PENDING: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_PAUSED: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]

class RestoreKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESTORE_KIND_UNSPECIFIED: _ClassVar[RestoreKind]
    RESTORE_KIND_NONE: _ClassVar[RestoreKind]
    RESTORE_KIND_PEERS: _ClassVar[RestoreKind]
    RESTORE_KIND_CHECKPOINT: _ClassVar[RestoreKind]
    RESTORE_KIND_PEER_COPY: _ClassVar[RestoreKind]

class PlanAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLAN_ACTION_UNSPECIFIED: _ClassVar[PlanAction]
    PLAN_ACTION_RUN: _ClassVar[PlanAction]
    PLAN_ACTION_WAIT: _ClassVar[PlanAction]
    PLAN_ACTION_STOP: _ClassVar[PlanAction]
STATE_LOST_POLICY_UNSPECIFIED: StateLostPolicy
STATE_LOST_POLICY_RESTART: StateLostPolicy
STATE_LOST_POLICY_FAIL: StateLostPolicy
STOP_ACTION_UNSPECIFIED: StopAction
STOP_ACTION_PAUSE: StopAction
STOP_ACTION_FAIL: StopAction
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_PENDING: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_PAUSED: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState
RESTORE_KIND_UNSPECIFIED: RestoreKind
RESTORE_KIND_NONE: RestoreKind
RESTORE_KIND_PEERS: RestoreKind
RESTORE_KIND_CHECKPOINT: RestoreKind
RESTORE_KIND_PEER_COPY: RestoreKind
PLAN_ACTION_UNSPECIFIED: PlanAction
PLAN_ACTION_RUN: PlanAction
PLAN_ACTION_WAIT: PlanAction
PLAN_ACTION_STOP: PlanAction

class Layout(_message.Message):
    __slots__ = ("tp", "pp", "ep", "shard", "min_pp")
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    EP_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    MIN_PP_FIELD_NUMBER: _ClassVar[int]
    tp: int
    pp: int
    ep: int
    shard: int
    min_pp: int
    def __init__(self, tp: _Optional[int] = ..., pp: _Optional[int] = ..., ep: _Optional[int] = ..., shard: _Optional[int] = ..., min_pp: _Optional[int] = ...) -> None: ...

class DataSpec(_message.Message):
    __slots__ = ("num_samples", "global_batch_size", "seed")
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    num_samples: int
    global_batch_size: int
    seed: int
    def __init__(self, num_samples: _Optional[int] = ..., global_batch_size: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class CheckpointSpec(_message.Message):
    __slots__ = ("uri", "every_steps", "keep_last", "keep_every", "auto_interval", "min_every_steps", "max_every_steps", "mtbf_prior_s")
    URI_FIELD_NUMBER: _ClassVar[int]
    EVERY_STEPS_FIELD_NUMBER: _ClassVar[int]
    KEEP_LAST_FIELD_NUMBER: _ClassVar[int]
    KEEP_EVERY_FIELD_NUMBER: _ClassVar[int]
    AUTO_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    MIN_EVERY_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_EVERY_STEPS_FIELD_NUMBER: _ClassVar[int]
    MTBF_PRIOR_S_FIELD_NUMBER: _ClassVar[int]
    uri: str
    every_steps: int
    keep_last: int
    keep_every: int
    auto_interval: bool
    min_every_steps: int
    max_every_steps: int
    mtbf_prior_s: int
    def __init__(self, uri: _Optional[str] = ..., every_steps: _Optional[int] = ..., keep_last: _Optional[int] = ..., keep_every: _Optional[int] = ..., auto_interval: _Optional[bool] = ..., min_every_steps: _Optional[int] = ..., max_every_steps: _Optional[int] = ..., mtbf_prior_s: _Optional[int] = ...) -> None: ...

class CheckpointInterval(_message.Message):
    __slots__ = ("every_steps", "mtbf_s", "failures", "cost_s", "step_s", "basis", "rollbacks")
    EVERY_STEPS_FIELD_NUMBER: _ClassVar[int]
    MTBF_S_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    COST_S_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    BASIS_FIELD_NUMBER: _ClassVar[int]
    ROLLBACKS_FIELD_NUMBER: _ClassVar[int]
    every_steps: int
    mtbf_s: float
    failures: int
    cost_s: float
    step_s: float
    basis: str
    rollbacks: int
    def __init__(self, every_steps: _Optional[int] = ..., mtbf_s: _Optional[float] = ..., failures: _Optional[int] = ..., cost_s: _Optional[float] = ..., step_s: _Optional[float] = ..., basis: _Optional[str] = ..., rollbacks: _Optional[int] = ...) -> None: ...

class PeerCopySpec(_message.Message):
    __slots__ = ("every_steps",)
    EVERY_STEPS_FIELD_NUMBER: _ClassVar[int]
    every_steps: int
    def __init__(self, every_steps: _Optional[int] = ...) -> None: ...

class FailurePolicy(_message.Message):
    __slots__ = ("max_per_step", "window_s", "plan_wait_s", "on_state_lost", "storage_outage_s")
    MAX_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    PLAN_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    ON_STATE_LOST_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OUTAGE_S_FIELD_NUMBER: _ClassVar[int]
    max_per_step: int
    window_s: int
    plan_wait_s: int
    on_state_lost: StateLostPolicy
    storage_outage_s: int
    def __init__(self, max_per_step: _Optional[int] = ..., window_s: _Optional[int] = ..., plan_wait_s: _Optional[int] = ..., on_state_lost: _Optional[_Union[StateLostPolicy, str]] = ..., storage_outage_s: _Optional[int] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("name", "min_workers", "max_workers", "layout", "data", "checkpoint", "max_steps", "failures", "peer_copies", "price_per_node_hour", "controls")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MIN_WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_WORKERS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    PEER_COPIES_FIELD_NUMBER: _ClassVar[int]
    PRICE_PER_NODE_HOUR_FIELD_NUMBER: _ClassVar[int]
    CONTROLS_FIELD_NUMBER: _ClassVar[int]
    name: str
    min_workers: int
    max_workers: int
    layout: Layout
    data: DataSpec
    checkpoint: CheckpointSpec
    max_steps: int
    failures: FailurePolicy
    peer_copies: PeerCopySpec
    price_per_node_hour: float
    controls: ControlsSpec
    def __init__(self, name: _Optional[str] = ..., min_workers: _Optional[int] = ..., max_workers: _Optional[int] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., data: _Optional[_Union[DataSpec, _Mapping]] = ..., checkpoint: _Optional[_Union[CheckpointSpec, _Mapping]] = ..., max_steps: _Optional[int] = ..., failures: _Optional[_Union[FailurePolicy, _Mapping]] = ..., peer_copies: _Optional[_Union[PeerCopySpec, _Mapping]] = ..., price_per_node_hour: _Optional[float] = ..., controls: _Optional[_Union[ControlsSpec, _Mapping]] = ...) -> None: ...

class ControlsSpec(_message.Message):
    __slots__ = ("stop", "bad_step", "straggler")
    STOP_FIELD_NUMBER: _ClassVar[int]
    BAD_STEP_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_FIELD_NUMBER: _ClassVar[int]
    stop: StopRules
    bad_step: BadStepPolicy
    straggler: StragglerPolicy
    def __init__(self, stop: _Optional[_Union[StopRules, _Mapping]] = ..., bad_step: _Optional[_Union[BadStepPolicy, _Mapping]] = ..., straggler: _Optional[_Union[StragglerPolicy, _Mapping]] = ...) -> None: ...

class StragglerPolicy(_message.Message):
    __slots__ = ("enabled", "factor", "window_steps", "cooldown_s", "change_cost_s", "horizon_steps")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    FACTOR_FIELD_NUMBER: _ClassVar[int]
    WINDOW_STEPS_FIELD_NUMBER: _ClassVar[int]
    COOLDOWN_S_FIELD_NUMBER: _ClassVar[int]
    CHANGE_COST_S_FIELD_NUMBER: _ClassVar[int]
    HORIZON_STEPS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    factor: float
    window_steps: int
    cooldown_s: int
    change_cost_s: float
    horizon_steps: int
    def __init__(self, enabled: _Optional[bool] = ..., factor: _Optional[float] = ..., window_steps: _Optional[int] = ..., cooldown_s: _Optional[int] = ..., change_cost_s: _Optional[float] = ..., horizon_steps: _Optional[int] = ...) -> None: ...

class SetAside(_message.Message):
    __slots__ = ("member_id", "until", "times", "returned")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    UNTIL_FIELD_NUMBER: _ClassVar[int]
    TIMES_FIELD_NUMBER: _ClassVar[int]
    RETURNED_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    until: _timestamp_pb2.Timestamp
    times: int
    returned: bool
    def __init__(self, member_id: _Optional[str] = ..., until: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., times: _Optional[int] = ..., returned: _Optional[bool] = ...) -> None: ...

class BadStepPolicy(_message.Message):
    __slots__ = ("enabled", "max_in_window", "window_steps", "loss_spike_factor", "loss_window_steps")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_WINDOW_FIELD_NUMBER: _ClassVar[int]
    WINDOW_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOSS_SPIKE_FACTOR_FIELD_NUMBER: _ClassVar[int]
    LOSS_WINDOW_STEPS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    max_in_window: int
    window_steps: int
    loss_spike_factor: float
    loss_window_steps: int
    def __init__(self, enabled: _Optional[bool] = ..., max_in_window: _Optional[int] = ..., window_steps: _Optional[int] = ..., loss_spike_factor: _Optional[float] = ..., loss_window_steps: _Optional[int] = ...) -> None: ...

class StopRules(_message.Message):
    __slots__ = ("goodput_floor", "window_s", "cost_per_step_ceiling", "no_progress_s", "action")
    GOODPUT_FLOOR_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    COST_PER_STEP_CEILING_FIELD_NUMBER: _ClassVar[int]
    NO_PROGRESS_S_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    goodput_floor: float
    window_s: int
    cost_per_step_ceiling: float
    no_progress_s: int
    action: StopAction
    def __init__(self, goodput_floor: _Optional[float] = ..., window_s: _Optional[int] = ..., cost_per_step_ceiling: _Optional[float] = ..., no_progress_s: _Optional[int] = ..., action: _Optional[_Union[StopAction, str]] = ...) -> None: ...

class DataCursor(_message.Message):
    __slots__ = ("epoch", "offset")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    offset: int
    def __init__(self, epoch: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class CheckpointRef(_message.Message):
    __slots__ = ("step", "uri", "generation", "world_size", "size_bytes", "cursor", "committed_at")
    STEP_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    step: int
    uri: str
    generation: int
    world_size: int
    size_bytes: int
    cursor: DataCursor
    committed_at: _timestamp_pb2.Timestamp
    def __init__(self, step: _Optional[int] = ..., uri: _Optional[str] = ..., generation: _Optional[int] = ..., world_size: _Optional[int] = ..., size_bytes: _Optional[int] = ..., cursor: _Optional[_Union[DataCursor, _Mapping]] = ..., committed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("state", "generation", "world_size", "members", "spares", "step", "samples_consumed", "loss", "last_checkpoint", "message", "checkpoint_error", "restore_step", "updated_at", "cursor", "num_restores", "steps_redone", "num_failures", "state_holders", "holders_step", "num_state_losses", "steps_lost", "storage_unavailable_since", "member_timing", "set_aside", "num_store_intrusions", "last_store_intrusion", "planner_error")
    STATE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    SPARES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_CONSUMED_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ERROR_FIELD_NUMBER: _ClassVar[int]
    RESTORE_STEP_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    NUM_RESTORES_FIELD_NUMBER: _ClassVar[int]
    STEPS_REDONE_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    STATE_HOLDERS_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_STATE_LOSSES_FIELD_NUMBER: _ClassVar[int]
    STEPS_LOST_FIELD_NUMBER: _ClassVar[int]
    STORAGE_UNAVAILABLE_SINCE_FIELD_NUMBER: _ClassVar[int]
    MEMBER_TIMING_FIELD_NUMBER: _ClassVar[int]
    SET_ASIDE_FIELD_NUMBER: _ClassVar[int]
    NUM_STORE_INTRUSIONS_FIELD_NUMBER: _ClassVar[int]
    LAST_STORE_INTRUSION_FIELD_NUMBER: _ClassVar[int]
    PLANNER_ERROR_FIELD_NUMBER: _ClassVar[int]
    state: JobState
    generation: int
    world_size: int
    members: _containers.RepeatedScalarFieldContainer[str]
    spares: _containers.RepeatedScalarFieldContainer[str]
    step: int
    samples_consumed: int
    loss: float
    last_checkpoint: CheckpointRef
    message: str
    checkpoint_error: str
    restore_step: int
    updated_at: _timestamp_pb2.Timestamp
    cursor: DataCursor
    num_restores: int
    steps_redone: int
    num_failures: int
    state_holders: _containers.RepeatedScalarFieldContainer[str]
    holders_step: int
    num_state_losses: int
    steps_lost: int
    storage_unavailable_since: _timestamp_pb2.Timestamp
    member_timing: _containers.RepeatedCompositeFieldContainer[MemberTiming]
    set_aside: _containers.RepeatedCompositeFieldContainer[SetAside]
    num_store_intrusions: int
    last_store_intrusion: str
    planner_error: str
    def __init__(self, state: _Optional[_Union[JobState, str]] = ..., generation: _Optional[int] = ..., world_size: _Optional[int] = ..., members: _Optional[_Iterable[str]] = ..., spares: _Optional[_Iterable[str]] = ..., step: _Optional[int] = ..., samples_consumed: _Optional[int] = ..., loss: _Optional[float] = ..., last_checkpoint: _Optional[_Union[CheckpointRef, _Mapping]] = ..., message: _Optional[str] = ..., checkpoint_error: _Optional[str] = ..., restore_step: _Optional[int] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., cursor: _Optional[_Union[DataCursor, _Mapping]] = ..., num_restores: _Optional[int] = ..., steps_redone: _Optional[int] = ..., num_failures: _Optional[int] = ..., state_holders: _Optional[_Iterable[str]] = ..., holders_step: _Optional[int] = ..., num_state_losses: _Optional[int] = ..., steps_lost: _Optional[int] = ..., storage_unavailable_since: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., member_timing: _Optional[_Iterable[_Union[MemberTiming, _Mapping]]] = ..., set_aside: _Optional[_Iterable[_Union[SetAside, _Mapping]]] = ..., num_store_intrusions: _Optional[int] = ..., last_store_intrusion: _Optional[str] = ..., planner_error: _Optional[str] = ...) -> None: ...

class MemberTiming(_message.Message):
    __slots__ = ("member_id", "compute_p50_s", "collective_p50_s", "num_steps", "node_rank")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_P50_S_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_P50_S_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    compute_p50_s: float
    collective_p50_s: float
    num_steps: int
    node_rank: int
    def __init__(self, member_id: _Optional[str] = ..., compute_p50_s: _Optional[float] = ..., collective_p50_s: _Optional[float] = ..., num_steps: _Optional[int] = ..., node_rank: _Optional[int] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("id", "spec", "status", "created_at", "started_at", "finished_at")
    ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    spec: JobSpec
    status: JobStatus
    created_at: _timestamp_pb2.Timestamp
    started_at: _timestamp_pb2.Timestamp
    finished_at: _timestamp_pb2.Timestamp
    def __init__(self, id: _Optional[str] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., status: _Optional[_Union[JobStatus, _Mapping]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., finished_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class Member(_message.Message):
    __slots__ = ("id", "job_id", "host", "rendezvous_port", "num_local_ranks", "joined_at", "join_order", "draining", "join_token")
    ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_PORT_FIELD_NUMBER: _ClassVar[int]
    NUM_LOCAL_RANKS_FIELD_NUMBER: _ClassVar[int]
    JOINED_AT_FIELD_NUMBER: _ClassVar[int]
    JOIN_ORDER_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    JOIN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    id: str
    job_id: str
    host: str
    rendezvous_port: int
    num_local_ranks: int
    joined_at: _timestamp_pb2.Timestamp
    join_order: int
    draining: bool
    join_token: str
    def __init__(self, id: _Optional[str] = ..., job_id: _Optional[str] = ..., host: _Optional[str] = ..., rendezvous_port: _Optional[int] = ..., num_local_ranks: _Optional[int] = ..., joined_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., join_order: _Optional[int] = ..., draining: _Optional[bool] = ..., join_token: _Optional[str] = ...) -> None: ...

class PlanMember(_message.Message):
    __slots__ = ("member_id", "host", "node_rank", "first_rank", "num_local_ranks")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    FIRST_RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_LOCAL_RANKS_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    host: str
    node_rank: int
    first_rank: int
    num_local_ranks: int
    def __init__(self, member_id: _Optional[str] = ..., host: _Optional[str] = ..., node_rank: _Optional[int] = ..., first_rank: _Optional[int] = ..., num_local_ranks: _Optional[int] = ...) -> None: ...

class ParallelLayout(_message.Message):
    __slots__ = ("dp", "tp", "pp", "ep", "replicate", "shard")
    DP_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    EP_FIELD_NUMBER: _ClassVar[int]
    REPLICATE_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    dp: int
    tp: int
    pp: int
    ep: int
    replicate: int
    shard: int
    def __init__(self, dp: _Optional[int] = ..., tp: _Optional[int] = ..., pp: _Optional[int] = ..., ep: _Optional[int] = ..., replicate: _Optional[int] = ..., shard: _Optional[int] = ...) -> None: ...

class RestoreSource(_message.Message):
    __slots__ = ("kind", "source_rank", "checkpoint")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SOURCE_RANK_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    kind: RestoreKind
    source_rank: int
    checkpoint: CheckpointRef
    def __init__(self, kind: _Optional[_Union[RestoreKind, str]] = ..., source_rank: _Optional[int] = ..., checkpoint: _Optional[_Union[CheckpointRef, _Mapping]] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("job_id", "generation", "action", "world_size", "members", "spares", "layout", "master_addr", "master_port", "cursor", "step", "restore", "spec", "reason", "created_at", "nodes", "num_spares", "digest", "rendezvous_secret")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    SPARES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    NUM_SPARES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_SECRET_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    generation: int
    action: PlanAction
    world_size: int
    members: _containers.RepeatedCompositeFieldContainer[PlanMember]
    spares: _containers.RepeatedScalarFieldContainer[str]
    layout: ParallelLayout
    master_addr: str
    master_port: int
    cursor: DataCursor
    step: int
    restore: RestoreSource
    spec: JobSpec
    reason: str
    created_at: _timestamp_pb2.Timestamp
    nodes: _containers.RepeatedCompositeFieldContainer[NodeRun]
    num_spares: int
    digest: bytes
    rendezvous_secret: str
    def __init__(self, job_id: _Optional[str] = ..., generation: _Optional[int] = ..., action: _Optional[_Union[PlanAction, str]] = ..., world_size: _Optional[int] = ..., members: _Optional[_Iterable[_Union[PlanMember, _Mapping]]] = ..., spares: _Optional[_Iterable[str]] = ..., layout: _Optional[_Union[ParallelLayout, _Mapping]] = ..., master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., cursor: _Optional[_Union[DataCursor, _Mapping]] = ..., step: _Optional[int] = ..., restore: _Optional[_Union[RestoreSource, _Mapping]] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., reason: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., nodes: _Optional[_Iterable[_Union[NodeRun, _Mapping]]] = ..., num_spares: _Optional[int] = ..., digest: _Optional[bytes] = ..., rendezvous_secret: _Optional[str] = ...) -> None: ...

class NodeRun(_message.Message):
    __slots__ = ("num_nodes", "num_local_ranks")
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    NUM_LOCAL_RANKS_FIELD_NUMBER: _ClassVar[int]
    num_nodes: int
    num_local_ranks: int
    def __init__(self, num_nodes: _Optional[int] = ..., num_local_ranks: _Optional[int] = ...) -> None: ...
