from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AckStepsRequest(_message.Message):
    __slots__ = ["rank", "through_step"]
    RANK_FIELD_NUMBER: _ClassVar[int]
    THROUGH_STEP_FIELD_NUMBER: _ClassVar[int]
    rank: int
    through_step: int
    def __init__(self, rank: _Optional[int] = ..., through_step: _Optional[int] = ...) -> None: ...

class AckStepsResponse(_message.Message):
    __slots__ = ["acked_through", "acks_with_get_batch"]
    ACKED_THROUGH_FIELD_NUMBER: _ClassVar[int]
    ACKS_WITH_GET_BATCH_FIELD_NUMBER: _ClassVar[int]
    acked_through: int
    acks_with_get_batch: bool
    def __init__(self, acked_through: _Optional[int] = ..., acks_with_get_batch: bool = ...) -> None: ...

class Counters(_message.Message):
    __slots__ = ["batches_rejected", "policy_tokens_assembled", "revisits_sampled", "rollouts_accepted", "rollouts_duplicate", "rollouts_expired", "rollouts_received", "rollouts_saved_by_filter", "rollouts_stale", "rollouts_trained", "steps_assembled", "tasks_requested", "tasks_sampled", "trainer_reports", "zero_advantage_groups", "zero_advantage_rollouts_dropped"]
    BATCHES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    POLICY_TOKENS_ASSEMBLED_FIELD_NUMBER: _ClassVar[int]
    REVISITS_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_SAVED_BY_FILTER_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_STALE_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    STEPS_ASSEMBLED_FIELD_NUMBER: _ClassVar[int]
    TASKS_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    TASKS_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    TRAINER_REPORTS_FIELD_NUMBER: _ClassVar[int]
    ZERO_ADVANTAGE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ZERO_ADVANTAGE_ROLLOUTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    batches_rejected: int
    policy_tokens_assembled: int
    revisits_sampled: int
    rollouts_accepted: int
    rollouts_duplicate: int
    rollouts_expired: int
    rollouts_received: int
    rollouts_saved_by_filter: int
    rollouts_stale: int
    rollouts_trained: int
    steps_assembled: int
    tasks_requested: int
    tasks_sampled: int
    trainer_reports: int
    zero_advantage_groups: int
    zero_advantage_rollouts_dropped: int
    def __init__(self, rollouts_received: _Optional[int] = ..., rollouts_accepted: _Optional[int] = ..., rollouts_duplicate: _Optional[int] = ..., rollouts_stale: _Optional[int] = ..., batches_rejected: _Optional[int] = ..., zero_advantage_groups: _Optional[int] = ..., zero_advantage_rollouts_dropped: _Optional[int] = ..., steps_assembled: _Optional[int] = ..., rollouts_trained: _Optional[int] = ..., policy_tokens_assembled: _Optional[int] = ..., trainer_reports: _Optional[int] = ..., tasks_sampled: _Optional[int] = ..., revisits_sampled: _Optional[int] = ..., tasks_requested: _Optional[int] = ..., rollouts_saved_by_filter: _Optional[int] = ..., rollouts_expired: _Optional[int] = ...) -> None: ...

class FrontEnd(_message.Message):
    __slots__ = ["address", "id", "last_seen_seconds", "node_id", "slot", "state"]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    address: str
    id: str
    last_seen_seconds: float
    node_id: str
    slot: str
    state: str
    def __init__(self, id: _Optional[str] = ..., address: _Optional[str] = ..., node_id: _Optional[str] = ..., slot: _Optional[str] = ..., state: _Optional[str] = ..., last_seen_seconds: _Optional[float] = ...) -> None: ...

class GetBatchRequest(_message.Message):
    __slots__ = ["acked_through_step", "rank", "step", "timeout_ms"]
    ACKED_THROUGH_STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    acked_through_step: int
    rank: int
    step: int
    timeout_ms: int
    def __init__(self, step: _Optional[int] = ..., rank: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., acked_through_step: _Optional[int] = ...) -> None: ...

class GetBatchResponse(_message.Message):
    __slots__ = ["microbatches", "microbatches_per_rank", "min_policy_version", "num_rollouts", "policy_token_count", "policy_version", "rank", "ready", "step", "world_size"]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    POLICY_TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    microbatches: _containers.RepeatedCompositeFieldContainer[Microbatch]
    microbatches_per_rank: int
    min_policy_version: int
    num_rollouts: int
    policy_token_count: int
    policy_version: int
    rank: int
    ready: bool
    step: int
    world_size: int
    def __init__(self, ready: bool = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., policy_token_count: _Optional[int] = ..., microbatches_per_rank: _Optional[int] = ..., policy_version: _Optional[int] = ..., min_policy_version: _Optional[int] = ..., microbatches: _Optional[_Iterable[_Union[Microbatch, _Mapping]]] = ..., num_rollouts: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class Microbatch(_message.Message):
    __slots__ = ["arrow_ipc", "cu_seqlens", "max_seqlen", "num_tokens", "policy_tokens", "rollout_ids"]
    ARROW_IPC_FIELD_NUMBER: _ClassVar[int]
    CU_SEQLENS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQLEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POLICY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_IDS_FIELD_NUMBER: _ClassVar[int]
    arrow_ipc: bytes
    cu_seqlens: _containers.RepeatedScalarFieldContainer[int]
    max_seqlen: int
    num_tokens: int
    policy_tokens: int
    rollout_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, arrow_ipc: _Optional[bytes] = ..., cu_seqlens: _Optional[_Iterable[int]] = ..., max_seqlen: _Optional[int] = ..., rollout_ids: _Optional[_Iterable[str]] = ..., num_tokens: _Optional[int] = ..., policy_tokens: _Optional[int] = ...) -> None: ...

class RegisterTasksRequest(_message.Message):
    __slots__ = ["task_ids"]
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    task_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, task_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterTasksResponse(_message.Message):
    __slots__ = ["added", "total_tasks"]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TASKS_FIELD_NUMBER: _ClassVar[int]
    added: int
    total_tasks: int
    def __init__(self, added: _Optional[int] = ..., total_tasks: _Optional[int] = ...) -> None: ...

class RolloutBatch(_message.Message):
    __slots__ = ["arrow_ipc", "sequence"]
    ARROW_IPC_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    arrow_ipc: bytes
    sequence: int
    def __init__(self, arrow_ipc: _Optional[bytes] = ..., sequence: _Optional[int] = ...) -> None: ...

class SampleTasksRequest(_message.Message):
    __slots__ = ["n"]
    N_FIELD_NUMBER: _ClassVar[int]
    n: int
    def __init__(self, n: _Optional[int] = ...) -> None: ...

class SampleTasksResponse(_message.Message):
    __slots__ = ["pass_rate", "revisit", "task_ids"]
    PASS_RATE_FIELD_NUMBER: _ClassVar[int]
    REVISIT_FIELD_NUMBER: _ClassVar[int]
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    pass_rate: _containers.RepeatedScalarFieldContainer[float]
    revisit: _containers.RepeatedScalarFieldContainer[bool]
    task_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, task_ids: _Optional[_Iterable[str]] = ..., revisit: _Optional[_Iterable[bool]] = ..., pass_rate: _Optional[_Iterable[float]] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ["buffered_bytes", "buffered_rollouts", "complete_groups", "counters", "front_end_list", "front_ends", "group_size", "held_bytes", "last_reports", "last_step", "max_buffered_bytes", "newest_policy_version", "next_step", "notes_refused", "open_groups", "prompts_per_step", "steps_waiting", "tasks_inside_filter", "tasks_outside_filter", "tasks_total", "token_budget", "trainer_policy_version", "version", "world_size"]
    BUFFERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    FRONT_ENDS_FIELD_NUMBER: _ClassVar[int]
    FRONT_END_LIST_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_REPORTS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_BUFFERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NEWEST_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    NOTES_REFUSED_FIELD_NUMBER: _ClassVar[int]
    OPEN_GROUPS_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_WAITING_FIELD_NUMBER: _ClassVar[int]
    TASKS_INSIDE_FILTER_FIELD_NUMBER: _ClassVar[int]
    TASKS_OUTSIDE_FILTER_FIELD_NUMBER: _ClassVar[int]
    TASKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    TRAINER_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    buffered_bytes: int
    buffered_rollouts: int
    complete_groups: int
    counters: Counters
    front_end_list: _containers.RepeatedCompositeFieldContainer[FrontEnd]
    front_ends: int
    group_size: int
    held_bytes: int
    last_reports: _containers.RepeatedCompositeFieldContainer[TrainerReport]
    last_step: StepStats
    max_buffered_bytes: int
    newest_policy_version: int
    next_step: int
    notes_refused: int
    open_groups: int
    prompts_per_step: int
    steps_waiting: _containers.RepeatedCompositeFieldContainer[StepWaiting]
    tasks_inside_filter: int
    tasks_outside_filter: int
    tasks_total: int
    token_budget: int
    trainer_policy_version: int
    version: str
    world_size: int
    def __init__(self, version: _Optional[str] = ..., next_step: _Optional[int] = ..., buffered_rollouts: _Optional[int] = ..., buffered_bytes: _Optional[int] = ..., complete_groups: _Optional[int] = ..., tasks_total: _Optional[int] = ..., tasks_inside_filter: _Optional[int] = ..., tasks_outside_filter: _Optional[int] = ..., steps_waiting: _Optional[_Iterable[_Union[StepWaiting, _Mapping]]] = ..., newest_policy_version: _Optional[int] = ..., counters: _Optional[_Union[Counters, _Mapping]] = ..., last_step: _Optional[_Union[StepStats, _Mapping]] = ..., world_size: _Optional[int] = ..., prompts_per_step: _Optional[int] = ..., group_size: _Optional[int] = ..., token_budget: _Optional[int] = ..., last_reports: _Optional[_Iterable[_Union[TrainerReport, _Mapping]]] = ..., open_groups: _Optional[int] = ..., front_ends: _Optional[int] = ..., notes_refused: _Optional[int] = ..., held_bytes: _Optional[int] = ..., max_buffered_bytes: _Optional[int] = ..., front_end_list: _Optional[_Iterable[_Union[FrontEnd, _Mapping]]] = ..., trainer_policy_version: _Optional[int] = ...) -> None: ...

class StepStats(_message.Message):
    __slots__ = ["compute_lockstep_efficiency", "compute_rank_imbalance", "computed_positions", "largest_microbatch_positions", "lockstep_efficiency", "microbatches_per_rank", "min_policy_version", "num_groups", "num_rollouts", "padded_positions", "policy_token_count", "policy_version", "rank_imbalance", "real_tokens", "response_bytes", "step", "zero_advantage_groups", "zero_advantage_groups_dropped"]
    COMPUTED_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_LOCKSTEP_EFFICIENCY_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_RANK_IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    LARGEST_MICROBATCH_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    LOCKSTEP_EFFICIENCY_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    NUM_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    PADDED_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    POLICY_TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    RANK_IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    REAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ZERO_ADVANTAGE_GROUPS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    ZERO_ADVANTAGE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    compute_lockstep_efficiency: float
    compute_rank_imbalance: float
    computed_positions: int
    largest_microbatch_positions: int
    lockstep_efficiency: float
    microbatches_per_rank: int
    min_policy_version: int
    num_groups: int
    num_rollouts: int
    padded_positions: int
    policy_token_count: int
    policy_version: int
    rank_imbalance: float
    real_tokens: int
    response_bytes: int
    step: int
    zero_advantage_groups: int
    zero_advantage_groups_dropped: int
    def __init__(self, step: _Optional[int] = ..., num_rollouts: _Optional[int] = ..., num_groups: _Optional[int] = ..., zero_advantage_groups: _Optional[int] = ..., policy_token_count: _Optional[int] = ..., real_tokens: _Optional[int] = ..., computed_positions: _Optional[int] = ..., padded_positions: _Optional[int] = ..., rank_imbalance: _Optional[float] = ..., lockstep_efficiency: _Optional[float] = ..., microbatches_per_rank: _Optional[int] = ..., policy_version: _Optional[int] = ..., zero_advantage_groups_dropped: _Optional[int] = ..., min_policy_version: _Optional[int] = ..., largest_microbatch_positions: _Optional[int] = ..., response_bytes: _Optional[int] = ..., compute_rank_imbalance: _Optional[float] = ..., compute_lockstep_efficiency: _Optional[float] = ...) -> None: ...

class StepWaiting(_message.Message):
    __slots__ = ["ranks_missing", "step"]
    RANKS_MISSING_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ranks_missing: _containers.RepeatedScalarFieldContainer[int]
    step: int
    def __init__(self, step: _Optional[int] = ..., ranks_missing: _Optional[_Iterable[int]] = ...) -> None: ...

class SubmitAck(_message.Message):
    __slots__ = ["accepted", "buffered_rollouts", "duplicate", "newest_policy_version", "sequence", "stale"]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    NEWEST_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    buffered_rollouts: int
    duplicate: int
    newest_policy_version: int
    sequence: int
    stale: int
    def __init__(self, sequence: _Optional[int] = ..., accepted: _Optional[int] = ..., duplicate: _Optional[int] = ..., stale: _Optional[int] = ..., newest_policy_version: _Optional[int] = ..., buffered_rollouts: _Optional[int] = ...) -> None: ...

class TrainerReport(_message.Message):
    __slots__ = ["loss", "policy_version", "rank", "ratio_outlier_share", "step", "step_seconds", "tokens_per_second"]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RATIO_OUTLIER_SHARE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    loss: float
    policy_version: int
    rank: int
    ratio_outlier_share: float
    step: int
    step_seconds: float
    tokens_per_second: float
    def __init__(self, step: _Optional[int] = ..., rank: _Optional[int] = ..., loss: _Optional[float] = ..., ratio_outlier_share: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., step_seconds: _Optional[float] = ..., policy_version: _Optional[int] = ...) -> None: ...

class TrainerReportAck(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...
