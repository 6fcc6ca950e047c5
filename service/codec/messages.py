"""Server-side wire <-> array conversion: the one place Arrow and protobuf meet numpy.

Ingest: `RolloutBatch.arrow_ipc` -> `RolloutBatchArrays` (flat per-token columns that alias
the Arrow buffers when the producer sent the documented dtypes; other widths are cast once,
safely). Serving: a materialized microbatch -> its `Microbatch` wire bytes, joined into a
rank's `GetBatchResponse`. Status: the scheduler's snapshot -> `StatusResponse`. Checks
beyond decoding are in `frontend.validation`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
from rlfeed import __version__
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto.arrow_schemas import MICROBATCH_SCHEMA
from rlfeed.proto.ipc_framing import ipc_stream_pieces
from rlfeed.proto.ipc_messages import check_one_plain_stream
from rlfeed.proto.wire import length_delimited, split_field
from rlfeed.sched.assembly import Microbatch, TokenColumns

if TYPE_CHECKING:  # records.py imports this module; only the annotations need these
    from rlfeed.service.config import SidecarConfig
    from rlfeed.service.scheduler.records import StatusSnapshot, StepRecord

# Mean rollout length from which policy tokens are counted rollout by rollout (a numpy call
# each) rather than by one widening reduceat over the whole mask.
_COUNT_PER_ROLLOUT_TOKENS = 512


@dataclass(frozen=True)
class RolloutBatchArrays:
    """One decoded rollout batch, n rollouts.

    Per rollout: rollout_ids / task_ids / group_ids (lists of n str), policy_versions int64
    [n], rewards float64 [n]. Per token: token_ids int32, action_mask uint8,
    sampler_logprobs float32, each flat with its own offsets int64 [n+1] starting at 0.
    `validation.validate_rollout_batch` checks the three offsets agree; after that,
    `columns` is the batch's TokenColumns (offsets = the batch's cu_seqlens).
    """

    rollout_ids: list[str]
    task_ids: list[str]
    group_ids: list[str]
    policy_versions: np.ndarray
    rewards: np.ndarray
    token_ids: np.ndarray
    action_mask: np.ndarray
    sampler_logprobs: np.ndarray
    offsets: np.ndarray
    mask_offsets: np.ndarray
    logprob_offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.rollout_ids)

    @property
    def lengths(self) -> np.ndarray:
        """int64 [n] tokens per rollout."""
        return np.diff(self.offsets)

    @property
    def columns(self) -> TokenColumns:
        return TokenColumns(
            offsets=self.offsets,
            token_ids=self.token_ids,
            action_mask=self.action_mask,
            sampler_logprobs=self.sampler_logprobs,
        )

    @property
    def policy_tokens(self) -> np.ndarray:
        """int64 [n] action-mask tokens per rollout. Long rollouts of a uint8 0/1 mask
        (what validation lets through) are counted per rollout: counting nonzero bytes
        only reads the mask, where a widening sum first writes it out as int64. Otherwise
        one reduceat pass (a cumulative sum over every token costs ten times as much)."""
        starts, lengths = self.offsets[:-1], np.diff(self.offsets)
        mask = self.action_mask
        if (
            len(starts)
            and mask.dtype == np.uint8
            and mask.size >= _COUNT_PER_ROLLOUT_TOKENS * len(starts)
            and mask.max() <= 1
        ):
            bounds = self.offsets.tolist()
            return np.fromiter(
                (np.count_nonzero(mask[a:b]) for a, b in itertools.pairwise(bounds)),
                np.int64,
                len(starts),
            )
        sums = np.zeros(len(starts), np.int64)
        nonempty = lengths > 0
        if nonempty.any():  # reduceat misreads empty segments: sum the others only
            sums[nonempty] = np.add.reduceat(
                self.action_mask[: self.offsets[-1]], starts[nonempty], dtype=np.int64
            )
        return sums

    @property
    def token_bytes(self) -> int:
        return int(self.token_ids.nbytes + self.action_mask.nbytes + self.sampler_logprobs.nbytes)


def _column(table: pa.Table, name: str) -> pa.Array:
    if name not in table.column_names:
        raise ValueError(
            f"arrow_ipc: missing column {name!r} (have {table.column_names}); "
            "see RolloutBatch in rlfeed.proto"
        )
    column = table.column(name)
    array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    return array


def _first_null_row(array: pa.Array) -> int:
    return int(np.flatnonzero(np.asarray(array.is_null()))[0])


def _strings(table: pa.Table, name: str, ids: list[str] | None) -> list[str]:
    array = _column(table, name)
    if not (pa.types.is_string(array.type) or pa.types.is_large_string(array.type)):
        raise ValueError(f"arrow_ipc: column {name!r} must be string, got {array.type}")
    if array.null_count:
        row = _first_null_row(array)
        who = f"rollout {ids[row]!r}" if ids else f"row {row}"
        raise ValueError(f"{who}: field {name} is null")
    return array.to_pylist()


def _scalars(table: pa.Table, name: str, ids: list[str], dtype: type, kind: str) -> np.ndarray:
    array = _column(table, name)
    accepts = pa.types.is_integer if kind == "integer" else pa.types.is_floating
    if not accepts(array.type):
        raise ValueError(f"arrow_ipc: column {name!r} must be {kind}, got {array.type}")
    if array.null_count:
        raise ValueError(f"rollout {ids[_first_null_row(array)]!r}: field {name} is null")
    return array.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


def _list(
    table: pa.Table, name: str, ids: list[str], arrow_type: pa.DataType
) -> tuple[np.ndarray, np.ndarray]:
    """(flat values of `arrow_type`, offsets int64 [n+1] from 0) of a list<...> column."""
    array = _column(table, name)
    if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)):
        raise ValueError(f"arrow_ipc: column {name!r} must be list<{arrow_type}>, got {array.type}")
    if array.null_count:
        raise ValueError(f"rollout {ids[_first_null_row(array)]!r}: field {name} is null")
    offsets = array.offsets.to_numpy().astype(np.int64, copy=False)
    # A sliced list array shares a larger values buffer; keep only this batch's range.
    values = array.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    if values.null_count:
        position = _first_null_row(values) + int(offsets[0])
        row = int(np.searchsorted(offsets, position, side="right") - 1)
        raise ValueError(f"rollout {ids[row]!r}: field {name} has a null entry")
    if values.type != arrow_type:
        try:
            values = values.cast(arrow_type)  # safe cast: overflow raises
        except pa.ArrowException as exc:
            raise ValueError(
                f"arrow_ipc: column {name!r} values must be {arrow_type}, got {values.type} ({exc})"
            ) from exc
    flat = values.to_numpy(zero_copy_only=False)
    return flat, offsets - offsets[0]


@dataclass(frozen=True)
class RolloutBatchView:
    """A received `RolloutBatch` whose `arrow_ipc` is a view of the request bytes (the
    generated message would copy the payload twice: into the parsed message, then out)."""

    arrow_ipc: memoryview
    sequence: int


def parse_rollout_batch(data: bytes) -> RolloutBatchView:
    """Serialized `RolloutBatch` -> RolloutBatchView without copying the payload; the
    field values `pb.RolloutBatch.FromString` gives (the last `arrow_ipc` wins, unknown
    fields are ignored). Bytes the in-place walk rejects go to FromString, so malformed
    input raises what it always raised."""
    try:
        payloads, rest = split_field(memoryview(data), 1)  # arrow_ipc = 1
        sequence = pb.RolloutBatch.FromString(rest).sequence
    except ValueError:
        message = pb.RolloutBatch.FromString(data)  # DecodeError for malformed bytes
        return RolloutBatchView(memoryview(message.arrow_ipc), message.sequence)
    return RolloutBatchView(payloads[-1] if payloads else memoryview(b""), sequence)


def decode_rollout_batch(arrow_ipc: bytes | memoryview) -> RolloutBatchArrays:
    """Arrow IPC stream bytes -> RolloutBatchArrays; ValueError on a malformed stream
    (anything pyarrow raises on it included), a stream that is not exactly one
    uncompressed stream (`ipc_messages`), a missing column, a wrong type or a null."""
    check_one_plain_stream(arrow_ipc)  # before pyarrow reads (or inflates) anything
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(arrow_ipc))
        table = reader.read_all()
        # Full validation (offsets monotonic and in range, UTF-8) before any buffer is read:
        # a crafted stream must be an INVALID_ARGUMENT, never an out-of-bounds read.
        table.validate(full=True)
    except (pa.ArrowException, OSError) as exc:
        # ArrowException: every pyarrow error, e.g. ArrowNotImplementedError for an
        # integer of 4, 12 or 128 bits declared in the schema.
        raise ValueError(f"arrow_ipc: not a readable Arrow IPC stream ({exc})") from exc
    try:
        return _batch_arrays(table)
    except pa.ArrowException as exc:  # a column pyarrow cannot convert
        raise ValueError(f"arrow_ipc: unreadable column ({type(exc).__name__}: {exc})") from exc


def _batch_arrays(table: pa.Table) -> RolloutBatchArrays:
    duplicated = sorted({n for n in table.column_names if table.column_names.count(n) > 1})
    if duplicated:
        raise ValueError(f"arrow_ipc: column(s) {duplicated} appear more than once")
    rollout_ids = _strings(table, "rollout_id", None)
    token_ids, offsets = _list(table, "token_ids", rollout_ids, pa.int32())
    action_mask, mask_offsets = _list(table, "action_mask", rollout_ids, pa.uint8())
    logprobs, logprob_offsets = _list(table, "sampler_logprobs", rollout_ids, pa.float32())
    return RolloutBatchArrays(
        rollout_ids=rollout_ids,
        task_ids=_strings(table, "task_id", rollout_ids),
        group_ids=_strings(table, "group_id", rollout_ids),
        policy_versions=_scalars(table, "policy_version", rollout_ids, np.int64, "integer"),
        rewards=_scalars(table, "reward", rollout_ids, np.float64, "float"),
        token_ids=token_ids,
        action_mask=action_mask,
        sampler_logprobs=logprobs,
        offsets=offsets,
        mask_offsets=mask_offsets,
        logprob_offsets=logprob_offsets,
    )


def _ipc_buffer(batch: pa.RecordBatch) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue()


def _ipc_bytes(batch: pa.RecordBatch) -> bytes:
    return _ipc_buffer(batch).to_pybytes()


def _microbatch_record_batch(microbatch: Microbatch) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(
        [
            pa.array(microbatch.input_ids.astype(np.int32, copy=False)),
            pa.array(microbatch.position_ids.astype(np.int32, copy=False)),
            pa.array(microbatch.target_ids.astype(np.int32, copy=False)),
            pa.array(microbatch.loss_mask.astype(np.uint8, copy=False)),
            pa.array(microbatch.sampler_logprobs.astype(np.float32, copy=False)),
            pa.array(microbatch.advantages.astype(np.float32, copy=False)),
        ],
        schema=MICROBATCH_SCHEMA,
    )


def _microbatch_fields(microbatch: Microbatch, rollout_ids: Sequence[str]) -> dict:
    """Every Microbatch field but arrow_ipc."""
    return {
        "cu_seqlens": microbatch.cu_seqlens.tolist(),
        "max_seqlen": int(microbatch.max_seqlen),
        "rollout_ids": list(rollout_ids),
        "num_tokens": microbatch.num_tokens,
        "policy_tokens": int(microbatch.loss_mask.sum(dtype=np.int64)),
    }


def encode_microbatch(microbatch: Microbatch, rollout_ids: Sequence[str]) -> pb.Microbatch:
    """A materialized microbatch -> its wire message; rollout_ids[i] names sequence i."""
    return pb.Microbatch(
        arrow_ipc=_ipc_bytes(_microbatch_record_batch(microbatch)),
        **_microbatch_fields(microbatch, rollout_ids),
    )


# Serving writes protobuf's wire format for the bulk fields itself, so that the Arrow bytes
# are copied once, straight into the response, instead of into a Microbatch message, then
# into the GetBatchResponse, then out by SerializeToString.
_MICROBATCH_ARROW_IPC = 1  # Microbatch.arrow_ipc
_RESPONSE_MICROBATCH = 9  # GetBatchResponse.microbatches


def encode_microbatch_parts(microbatch: Microbatch, rollout_ids: Sequence[str]) -> list:
    """The serialized `encode_microbatch(...)` as buffers to join (no copy made yet; the
    Arrow body buffers are views of the microbatch's arrays)."""
    arrow, size = ipc_stream_pieces(_microbatch_record_batch(microbatch))
    return microbatch_parts(arrow, size, _microbatch_fields(microbatch, rollout_ids))[0]


def microbatch_parts(arrow: Sequence, arrow_size: int, fields: dict) -> tuple[list, int]:
    """(a serialized `Microbatch` as buffers to join, its size in bytes): `arrow` (pieces of
    `arrow_size` bytes in all) as its arrow_ipc, then `fields` (every other field, as
    `pb.Microbatch` takes them), in the order SerializeToString(deterministic=True) writes."""
    prefix = length_delimited(_MICROBATCH_ARROW_IPC, arrow_size)
    rest = pb.Microbatch(**fields).SerializeToString(deterministic=True)
    return [prefix, *arrow, rest], len(prefix) + arrow_size + len(rest)


def join_rank_response(
    header: pb.GetBatchResponse,
    microbatches: Sequence[list],
    sizes: Sequence[int] | None = None,
) -> bytes:
    """Serialized GetBatchResponse: `header` (no microbatches set) + the microbatches, each
    a list from `encode_microbatch_parts` (`sizes`: their sizes in bytes, when known).
    Byte-identical to setting `header.microbatches` and calling
    SerializeToString(deterministic=True): fields 1-8, then 9, then 10. The join is the one
    copy of the bulk data into the response."""
    if sizes is None:
        sizes = [sum(memoryview(part).nbytes for part in parts) for parts in microbatches]
    after = pb.GetBatchResponse(num_rollouts=header.num_rollouts)
    before = pb.GetBatchResponse()
    before.CopyFrom(header)
    before.ClearField("num_rollouts")
    pieces = [before.SerializeToString(deterministic=True)]
    for parts, size in zip(microbatches, sizes, strict=True):
        pieces += [length_delimited(_RESPONSE_MICROBATCH, size), *parts]
    pieces.append(after.SerializeToString(deterministic=True))
    return b"".join(pieces)


def decode_microbatch(message: pb.Microbatch) -> dict[str, np.ndarray]:
    """Wire microbatch -> numpy arrays (the MICROBATCH_SCHEMA columns plus cu_seqlens int32).

    The per-token arrays alias the message's bytes (read-only views)."""
    table = pa.ipc.open_stream(pa.py_buffer(message.arrow_ipc)).read_all()
    arrays = {
        name: (
            table.column(name).chunk(0).to_numpy()
            if table.num_rows and table.column(name).num_chunks == 1
            else table.column(name).to_numpy()
        )
        for name in MICROBATCH_SCHEMA.names
    }
    arrays["cu_seqlens"] = np.asarray(message.cu_seqlens, dtype=np.int32)
    return arrays


def status_to_proto(snapshot: StatusSnapshot, config: SidecarConfig) -> pb.StatusResponse:
    """A scheduler status snapshot -> the GetStatus answer (plus the run's shape)."""
    counters = pb.Counters(**vars(snapshot.counters))
    filtered_draws = snapshot.counters.tasks_sampled - snapshot.counters.revisits_sampled
    counters.rollouts_saved_by_filter = (
        snapshot.counters.tasks_requested - filtered_draws
    ) * config.rollouts.group_size
    response = pb.StatusResponse(
        version=__version__,
        next_step=snapshot.next_step,
        buffered_rollouts=snapshot.buffered_rollouts,
        buffered_bytes=snapshot.buffered_bytes,
        complete_groups=snapshot.complete_groups,
        open_groups=snapshot.open_groups,
        front_ends=snapshot.front_ends,
        notes_refused=snapshot.notes_refused,
        held_bytes=snapshot.held_bytes,
        max_buffered_bytes=config.rollouts.max_buffered_bytes,
        tasks_total=snapshot.tasks_total,
        tasks_inside_filter=snapshot.tasks_inside_filter,
        tasks_outside_filter=snapshot.tasks_total - snapshot.tasks_inside_filter,
        steps_waiting=[
            pb.StepWaiting(step=step, ranks_missing=ranks)
            for step, ranks in snapshot.steps_waiting.items()
        ],
        newest_policy_version=snapshot.newest_policy_version,
        counters=counters,
        world_size=config.batching.world_size,
        prompts_per_step=config.rollouts.prompts_per_step,
        group_size=config.rollouts.group_size,
        token_budget=config.batching.token_budget,
        last_reports=[
            pb.TrainerReport(rank=rank, **{k: v for k, v in report.items() if v == v})  # NaN: unset
            for rank, report in sorted(snapshot.last_reports.items())
        ],
    )
    if snapshot.trainer_policy_version >= 0:
        response.trainer_policy_version = snapshot.trainer_policy_version
    if snapshot.last_step is not None:
        response.last_step.CopyFrom(step_stats_to_proto(snapshot.last_step))
    response.front_end_list.extend(
        pb.FrontEnd(
            id=f.frontend_id,
            address=f.address,
            node_id=f.node_id,
            slot=f.slot,
            state=f.state,
            last_seen_seconds=f.last_seen_s,
        )
        for f in snapshot.front_end_list
    )
    return response


def step_stats_to_proto(record: StepRecord) -> pb.StepStats:
    """One step's statistics record -> its wire message (same field names)."""
    return pb.StepStats(**vars(record))
