from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RolloutBatch(_message.Message):
    __slots__ = ("arrow_ipc", "sequence")
    ARROW_IPC_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    arrow_ipc: bytes
    sequence: int
    def __init__(self, arrow_ipc: _Optional[bytes] = ..., sequence: _Optional[int] = ...) -> None: ...

class SubmitAck(_message.Message):
    __slots__ = ("sequence", "accepted", "duplicate", "stale", "newest_policy_version", "buffered_rollouts")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    NEWEST_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    accepted: int
    duplicate: int
    stale: int
    newest_policy_version: int
    buffered_rollouts: int
    def __init__(self, sequence: _Optional[int] = ..., accepted: _Optional[int] = ..., duplicate: _Optional[int] = ..., stale: _Optional[int] = ..., newest_policy_version: _Optional[int] = ..., buffered_rollouts: _Optional[int] = ...) -> None: ...

class RegisterTasksRequest(_message.Message):
    __slots__ = ("task_ids",)
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    task_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, task_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterTasksResponse(_message.Message):
    __slots__ = ("added", "total_tasks")
    ADDED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TASKS_FIELD_NUMBER: _ClassVar[int]
    added: int
    total_tasks: int
    def __init__(self, added: _Optional[int] = ..., total_tasks: _Optional[int] = ...) -> None: ...

class SampleTasksRequest(_message.Message):
    __slots__ = ("n",)
    N_FIELD_NUMBER: _ClassVar[int]
    n: int
    def __init__(self, n: _Optional[int] = ...) -> None: ...

class SampleTasksResponse(_message.Message):
    __slots__ = ("task_ids", "revisit", "pass_rate")
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    REVISIT_FIELD_NUMBER: _ClassVar[int]
    PASS_RATE_FIELD_NUMBER: _ClassVar[int]
    task_ids: _containers.RepeatedScalarFieldContainer[str]
    revisit: _containers.RepeatedScalarFieldContainer[bool]
    pass_rate: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, task_ids: _Optional[_Iterable[str]] = ..., revisit: _Optional[_Iterable[bool]] = ..., pass_rate: _Optional[_Iterable[float]] = ...) -> None: ...

class GetBatchRequest(_message.Message):
    __slots__ = ("step", "rank", "timeout_ms")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    step: int
    rank: int
    timeout_ms: int
    def __init__(self, step: _Optional[int] = ..., rank: _Optional[int] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class Microbatch(_message.Message):
    __slots__ = ("arrow_ipc", "cu_seqlens", "max_seqlen", "rollout_ids", "num_tokens", "policy_tokens")
    ARROW_IPC_FIELD_NUMBER: _ClassVar[int]
    CU_SEQLENS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQLEN_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POLICY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    arrow_ipc: bytes
    cu_seqlens: _containers.RepeatedScalarFieldContainer[int]
    max_seqlen: int
    rollout_ids: _containers.RepeatedScalarFieldContainer[str]
    num_tokens: int
    policy_tokens: int
    def __init__(self, arrow_ipc: _Optional[bytes] = ..., cu_seqlens: _Optional[_Iterable[int]] = ..., max_seqlen: _Optional[int] = ..., rollout_ids: _Optional[_Iterable[str]] = ..., num_tokens: _Optional[int] = ..., policy_tokens: _Optional[int] = ...) -> None: ...

class GetBatchResponse(_message.Message):
    __slots__ = ("ready", "step", "rank", "world_size", "policy_token_count", "microbatches_per_rank", "policy_version", "min_policy_version", "microbatches", "num_rollouts")
    READY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    POLICY_TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    NUM_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    step: int
    rank: int
    world_size: int
    policy_token_count: int
    microbatches_per_rank: int
    policy_version: int
    min_policy_version: int
    microbatches: _containers.RepeatedCompositeFieldContainer[Microbatch]
    num_rollouts: int
    def __init__(self, ready: _Optional[bool] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., policy_token_count: _Optional[int] = ..., microbatches_per_rank: _Optional[int] = ..., policy_version: _Optional[int] = ..., min_policy_version: _Optional[int] = ..., microbatches: _Optional[_Iterable[_Union[Microbatch, _Mapping]]] = ..., num_rollouts: _Optional[int] = ...) -> None: ...

class AckStepsRequest(_message.Message):
    __slots__ = ("rank", "through_step")
    RANK_FIELD_NUMBER: _ClassVar[int]
    THROUGH_STEP_FIELD_NUMBER: _ClassVar[int]
    rank: int
    through_step: int
    def __init__(self, rank: _Optional[int] = ..., through_step: _Optional[int] = ...) -> None: ...

class AckStepsResponse(_message.Message):
    __slots__ = ("acked_through",)
    ACKED_THROUGH_FIELD_NUMBER: _ClassVar[int]
    acked_through: int
    def __init__(self, acked_through: _Optional[int] = ...) -> None: ...

class TrainerReport(_message.Message):
    __slots__ = ("step", "rank", "loss", "ratio_outlier_share", "tokens_per_second", "step_seconds")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    RATIO_OUTLIER_SHARE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    rank: int
    loss: float
    ratio_outlier_share: float
    tokens_per_second: float
    step_seconds: float
    def __init__(self, step: _Optional[int] = ..., rank: _Optional[int] = ..., loss: _Optional[float] = ..., ratio_outlier_share: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., step_seconds: _Optional[float] = ...) -> None: ...

class TrainerReportAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StepWaiting(_message.Message):
    __slots__ = ("step", "ranks_missing")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANKS_MISSING_FIELD_NUMBER: _ClassVar[int]
    step: int
    ranks_missing: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step: _Optional[int] = ..., ranks_missing: _Optional[_Iterable[int]] = ...) -> None: ...

class StepStats(_message.Message):
    __slots__ = ("step", "num_rollouts", "num_groups", "zero_advantage_groups", "policy_token_count", "real_tokens", "computed_positions", "padded_positions", "rank_imbalance", "lockstep_efficiency", "microbatches_per_rank", "policy_version", "zero_advantage_groups_dropped", "min_policy_version", "largest_microbatch_positions", "response_bytes", "compute_rank_imbalance", "compute_lockstep_efficiency")
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ZERO_ADVANTAGE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    POLICY_TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    REAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    PADDED_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    RANK_IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    LOCKSTEP_EFFICIENCY_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ZERO_ADVANTAGE_GROUPS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LARGEST_MICROBATCH_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_RANK_IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_LOCKSTEP_EFFICIENCY_FIELD_NUMBER: _ClassVar[int]
    step: int
    num_rollouts: int
    num_groups: int
    zero_advantage_groups: int
    policy_token_count: int
    real_tokens: int
    computed_positions: int
    padded_positions: int
    rank_imbalance: float
    lockstep_efficiency: float
    microbatches_per_rank: int
    policy_version: int
    zero_advantage_groups_dropped: int
    min_policy_version: int
    largest_microbatch_positions: int
    response_bytes: int
    compute_rank_imbalance: float
    compute_lockstep_efficiency: float
    def __init__(self, step: _Optional[int] = ..., num_rollouts: _Optional[int] = ..., num_groups: _Optional[int] = ..., zero_advantage_groups: _Optional[int] = ..., policy_token_count: _Optional[int] = ..., real_tokens: _Optional[int] = ..., computed_positions: _Optional[int] = ..., padded_positions: _Optional[int] = ..., rank_imbalance: _Optional[float] = ..., lockstep_efficiency: _Optional[float] = ..., microbatches_per_rank: _Optional[int] = ..., policy_version: _Optional[int] = ..., zero_advantage_groups_dropped: _Optional[int] = ..., min_policy_version: _Optional[int] = ..., largest_microbatch_positions: _Optional[int] = ..., response_bytes: _Optional[int] = ..., compute_rank_imbalance: _Optional[float] = ..., compute_lockstep_efficiency: _Optional[float] = ...) -> None: ...

class Counters(_message.Message):
    __slots__ = ("rollouts_received", "rollouts_accepted", "rollouts_duplicate", "rollouts_stale", "batches_rejected", "zero_advantage_groups", "zero_advantage_rollouts_dropped", "steps_assembled", "rollouts_trained", "policy_tokens_assembled", "trainer_reports", "tasks_sampled", "revisits_sampled", "tasks_requested", "rollouts_saved_by_filter", "rollouts_expired")
    ROLLOUTS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_STALE_FIELD_NUMBER: _ClassVar[int]
    BATCHES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    ZERO_ADVANTAGE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ZERO_ADVANTAGE_ROLLOUTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    STEPS_ASSEMBLED_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    POLICY_TOKENS_ASSEMBLED_FIELD_NUMBER: _ClassVar[int]
    TRAINER_REPORTS_FIELD_NUMBER: _ClassVar[int]
    TASKS_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    REVISITS_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    TASKS_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_SAVED_BY_FILTER_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    rollouts_received: int
    rollouts_accepted: int
    rollouts_duplicate: int
    rollouts_stale: int
    batches_rejected: int
    zero_advantage_groups: int
    zero_advantage_rollouts_dropped: int
    steps_assembled: int
    rollouts_trained: int
    policy_tokens_assembled: int
    trainer_reports: int
    tasks_sampled: int
    revisits_sampled: int
    tasks_requested: int
    rollouts_saved_by_filter: int
    rollouts_expired: int
    def __init__(self, rollouts_received: _Optional[int] = ..., rollouts_accepted: _Optional[int] = ..., rollouts_duplicate: _Optional[int] = ..., rollouts_stale: _Optional[int] = ..., batches_rejected: _Optional[int] = ..., zero_advantage_groups: _Optional[int] = ..., zero_advantage_rollouts_dropped: _Optional[int] = ..., steps_assembled: _Optional[int] = ..., rollouts_trained: _Optional[int] = ..., policy_tokens_assembled: _Optional[int] = ..., trainer_reports: _Optional[int] = ..., tasks_sampled: _Optional[int] = ..., revisits_sampled: _Optional[int] = ..., tasks_requested: _Optional[int] = ..., rollouts_saved_by_filter: _Optional[int] = ..., rollouts_expired: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("version", "next_step", "buffered_rollouts", "buffered_bytes", "complete_groups", "tasks_total", "tasks_inside_filter", "tasks_outside_filter", "steps_waiting", "newest_policy_version", "counters", "last_step", "world_size", "prompts_per_step", "group_size", "token_budget", "last_reports", "open_groups", "front_ends", "notes_refused", "held_bytes", "max_buffered_bytes", "front_end_list")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    TASKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TASKS_INSIDE_FILTER_FIELD_NUMBER: _ClassVar[int]
    TASKS_OUTSIDE_FILTER_FIELD_NUMBER: _ClassVar[int]
    STEPS_WAITING_FIELD_NUMBER: _ClassVar[int]
    NEWEST_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    LAST_REPORTS_FIELD_NUMBER: _ClassVar[int]
    OPEN_GROUPS_FIELD_NUMBER: _ClassVar[int]
    FRONT_ENDS_FIELD_NUMBER: _ClassVar[int]
    NOTES_REFUSED_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BUFFERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FRONT_END_LIST_FIELD_NUMBER: _ClassVar[int]
    version: str
    next_step: int
    buffered_rollouts: int
    buffered_bytes: int
    complete_groups: int
    tasks_total: int
    tasks_inside_filter: int
    tasks_outside_filter: int
    steps_waiting: _containers.RepeatedCompositeFieldContainer[StepWaiting]
    newest_policy_version: int
    counters: Counters
    last_step: StepStats
    world_size: int
    prompts_per_step: int
    group_size: int
    token_budget: int
    last_reports: _containers.RepeatedCompositeFieldContainer[TrainerReport]
    open_groups: int
    front_ends: int
    notes_refused: int
    held_bytes: int
    max_buffered_bytes: int
    front_end_list: _containers.RepeatedCompositeFieldContainer[FrontEnd]
    def __init__(self, version: _Optional[str] = ..., next_step: _Optional[int] = ..., buffered_rollouts: _Optional[int] = ..., buffered_bytes: _Optional[int] = ..., complete_groups: _Optional[int] = ..., tasks_total: _Optional[int] = ..., tasks_inside_filter: _Optional[int] = ..., tasks_outside_filter: _Optional[int] = ..., steps_waiting: _Optional[_Iterable[_Union[StepWaiting, _Mapping]]] = ..., newest_policy_version: _Optional[int] = ..., counters: _Optional[_Union[Counters, _Mapping]] = ..., last_step: _Optional[_Union[StepStats, _Mapping]] = ..., world_size: _Optional[int] = ..., prompts_per_step: _Optional[int] = ..., group_size: _Optional[int] = ..., token_budget: _Optional[int] = ..., last_reports: _Optional[_Iterable[_Union[TrainerReport, _Mapping]]] = ..., open_groups: _Optional[int] = ..., front_ends: _Optional[int] = ..., notes_refused: _Optional[int] = ..., held_bytes: _Optional[int] = ..., max_buffered_bytes: _Optional[int] = ..., front_end_list: _Optional[_Iterable[_Union[FrontEnd, _Mapping]]] = ...) -> None: ...

class FrontEnd(_message.Message):
    __slots__ = ("id", "address", "node_id", "slot", "state", "last_seen_seconds")
    ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    address: str
    node_id: str
    slot: str
    state: str
    last_seen_seconds: float
    def __init__(self, id: _Optional[str] = ..., address: _Optional[str] = ..., node_id: _Optional[str] = ..., slot: _Optional[str] = ..., state: _Optional[str] = ..., last_seen_seconds: _Optional[float] = ...) -> None: ...
