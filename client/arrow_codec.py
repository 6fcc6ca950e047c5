"""The client's one conversion point between wire messages and arrays/tensors.

Producer side: rollouts -> `RolloutBatch.arrow_ipc`. Trainer side: a served
`GetBatchResponse` -> `MicrobatchTensors`, torch tensors that alias the received bytes, every
column as served (int32 ids and positions, uint8 mask, float32 log-probs and advantages):
widening would cost memory traffic per microbatch for nothing. The tensors are read-only in
spirit: write into a `.clone()`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto.arrow_schemas import (
    MICROBATCH_SCHEMA,
    ROLLOUT_SCHEMA,
    TOKEN_BYTES,
    numpy_dtype,
)
from rlfeed.proto.ipc_framing import ipc_stream_pieces, microbatch_framing, swap_placeholder_bodies
from rlfeed.proto.wire import encode_varint, length_delimited, split_field

if TYPE_CHECKING:  # torch is imported where tensors are made: producers never pay for it
    import torch


TOKEN_COLUMNS = ("token_ids", "action_mask", "sampler_logprobs")
_TOKEN_DTYPES = {"token_ids": np.int32, "action_mask": np.uint8, "sampler_logprobs": np.float32}


@dataclass
class RolloutColumns:
    """Rollouts accumulated column by column (what `RolloutWriter` buffers), n rows."""

    rollout_id: list[str]
    task_id: list[str]
    group_id: list[str]
    policy_version: list[int]
    reward: list[float]
    token_ids: list[np.ndarray]  # n arrays, int32 [L_i]
    action_mask: list[np.ndarray]  # n arrays, uint8 [L_i]
    sampler_logprobs: list[np.ndarray]  # n arrays, float32 [L_i]

    @classmethod
    def empty(cls) -> RolloutColumns:
        return cls([], [], [], [], [], [], [], [])

    def __len__(self) -> int:
        return len(self.rollout_id)

    def token_bytes(self) -> int:
        """The token payload of every row, in bytes (what `append` returned, summed)."""
        return sum(tokens.size for tokens in self.token_ids) * TOKEN_BYTES

    def append(
        self,
        *,
        rollout_id: str,
        task_id: str,
        group_id: str,
        policy_version: int,
        reward: float,
        token_ids: Sequence[int] | np.ndarray,
        action_mask: Sequence[int] | np.ndarray,
        sampler_logprobs: Sequence[float] | np.ndarray,
    ) -> int:
        """Add one rollout; returns its token payload in bytes. Lengths are checked here so
        a producer bug is reported at the call that made it, not by the server later."""
        # Straight-line code: this runs once per rollout on the producer's thread.
        tokens = np.asarray(token_ids, dtype=np.int32)
        mask = np.asarray(action_mask, dtype=np.uint8)
        logprobs = np.asarray(sampler_logprobs, dtype=np.float32)
        if tokens.ndim != 1 or mask.shape != tokens.shape or logprobs.shape != tokens.shape:
            _raise_shape_error(rollout_id, (tokens, mask, logprobs))
        self.rollout_id.append(str(rollout_id))
        self.task_id.append(str(task_id))
        self.group_id.append(str(group_id))
        self.policy_version.append(int(policy_version))
        self.reward.append(float(reward))
        self.token_ids.append(tokens)
        self.action_mask.append(mask)
        self.sampler_logprobs.append(logprobs)
        return tokens.size * TOKEN_BYTES


def _raise_shape_error(rollout_id: str, arrays: tuple[np.ndarray, ...]) -> None:
    length = arrays[0].size
    for name, array in zip(TOKEN_COLUMNS, arrays, strict=True):
        if array.ndim != 1:
            raise ValueError(f"rollout {rollout_id!r}: {name} must be 1-D, got {array.shape}")
        if array.size != length:
            raise ValueError(
                f"rollout {rollout_id!r}: {name} has {array.size} entries but token_ids "
                f"has {length}"
            )


def encode_rollouts(rows: RolloutColumns) -> bytes:
    """Rollouts -> the Arrow IPC stream of a `RolloutBatch` (one record batch).

    Per-token arrays become Arrow list columns whose offsets are the batch's cu_seqlens;
    their bytes are copied once, by the join (no per-token Python work).
    """
    pieces, _ = _rollout_stream_pieces(rows)
    return b"".join(pieces)


def encode_rollout_batch(rows: RolloutColumns, sequence: int) -> bytes:
    """The serialized `RolloutBatch(arrow_ipc=encode_rollouts(rows), sequence=sequence)`,
    written with one copy of the token data (the generated message would make three)."""
    pieces, size = _rollout_stream_pieces(rows)
    tail = [_SEQUENCE_TAG, encode_varint(sequence)] if sequence else []
    return b"".join([length_delimited(1, size), *pieces, *tail])  # arrow_ipc = 1


_SEQUENCE_TAG = b"\x10"  # RolloutBatch.sequence = 2, varint


def _rollout_stream_pieces(rows: RolloutColumns) -> tuple[list, int]:
    """The batch's Arrow IPC stream as buffers to join, whose token values are the rows'
    own arrays: the join is the one copy of the token data. Fresh memory is costly to fill
    (page faults), so not concatenating the values first saves a full pass over it.

    The stream's framing comes from pyarrow's writer run over placeholder values of the
    right length (uninitialized: never read, only their addresses and sizes matter); the
    placeholder body buffers are then swapped for the rows' arrays. If the writer does not
    hand them over as expected, the values are concatenated instead (the same bytes)."""
    offsets = _offsets(rows)
    total = int(offsets[-1])
    placeholders = {name: np.empty(total, _TOKEN_DTYPES[name]) for name in TOKEN_COLUMNS}
    pieces, size = _stream_pieces(rows, offsets, placeholders)
    if not total:
        return pieces, size
    if all(_joinable(getattr(rows, name), name) for name in TOKEN_COLUMNS):
        swaps = {
            placeholder.ctypes.data: [(placeholder.nbytes, getattr(rows, name))]
            for name, placeholder in placeholders.items()
        }
        swapped = swap_placeholder_bodies(pieces, swaps)
        if swapped is not None:
            return swapped, size
    return _stream_pieces(rows, offsets, _concatenated(rows))


def _offsets(rows: RolloutColumns) -> np.ndarray:
    lengths = np.fromiter((a.size for a in rows.token_ids), dtype=np.int64, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def _joinable(arrays: list[np.ndarray], name: str) -> bool:
    """Whether the arrays' bytes, joined, are the column's values (dtype, C order)."""
    dtype = np.dtype(_TOKEN_DTYPES[name])
    return all(a.dtype == dtype and a.flags.c_contiguous for a in arrays)


def _concatenated(rows: RolloutColumns) -> dict[str, np.ndarray]:
    return {
        name: np.concatenate(getattr(rows, name)).astype(_TOKEN_DTYPES[name], copy=False)
        if len(rows)
        else np.zeros(0, _TOKEN_DTYPES[name])
        for name in TOKEN_COLUMNS
    }


def _stream_pieces(
    rows: RolloutColumns, offsets: np.ndarray, values: dict[str, np.ndarray]
) -> tuple[list, int]:
    """The stream of `rows` with each token column's values taken from `values`."""
    offsets_array = pa.array(offsets)
    columns = [
        pa.array(rows.rollout_id, pa.string()),
        pa.array(rows.task_id, pa.string()),
        pa.array(rows.group_id, pa.string()),
        pa.array(rows.policy_version, pa.int64()),
        pa.array(rows.reward, pa.float64()),
        *(pa.ListArray.from_arrays(offsets_array, pa.array(values[n])) for n in TOKEN_COLUMNS),
    ]
    return ipc_stream_pieces(pa.RecordBatch.from_arrays(columns, schema=ROLLOUT_SCHEMA))


@dataclass(frozen=True)
class MicrobatchTensors:
    """One served packed row of T tokens for one rank, as torch tensors.

    Per token [T]: input_ids int32, position_ids int32 (restarting at 0 per sequence),
    target_ids int32 (0 at sequence ends), loss_mask uint8, sampler_logprobs float32,
    advantages float32. Per sequence: cu_seqlens int32 [n+1], rollout_ids (n strings).
    Per step: policy_token_count is the global N over all ranks (the constant loss
    normalizer), microbatches_per_rank the same on every rank.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    target_ids: torch.Tensor
    loss_mask: torch.Tensor
    sampler_logprobs: torch.Tensor
    advantages: torch.Tensor
    rollout_ids: tuple[str, ...]
    policy_token_count: int
    microbatches_per_rank: int
    policy_version: int
    step: int
    index: int  # position of this microbatch in the rank's step, 0-based

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def policy_tokens(self) -> int:
        """Policy tokens in this microbatch. The served mask is 0/1, so this counts: torch's
        sum of a uint8 tensor widens every element to int64 first (~10x slower than
        count_nonzero on a 4M-token mask, the same on 64k)."""
        import torch

        return int(torch.count_nonzero(self.loss_mask))


MICROBATCH_COLUMNS = {field.name: field.type for field in MICROBATCH_SCHEMA}
_MICROBATCH_DTYPES = [numpy_dtype(field.type) for field in MICROBATCH_SCHEMA]


def _column_tensors(arrow_ipc: bytes | memoryview, num_tokens: int) -> dict[str, torch.Tensor]:
    """Column name -> tensor aliasing the Arrow buffer (no copy for a null-free column)."""
    import torch

    if num_tokens == 0 and not arrow_ipc:
        return {
            name: torch.from_numpy(np.zeros(0, dtype=numpy_dtype(dtype)))
            for name, dtype in MICROBATCH_COLUMNS.items()
        }
    framing = microbatch_framing() if num_tokens > 0 else None
    framed = framing.columns(arrow_ipc, num_tokens, _MICROBATCH_DTYPES) if framing else None
    if framed is not None:  # what rlfeed serves, read at the offsets its framing gives
        return _tensors(dict(zip(MICROBATCH_SCHEMA.names, framed, strict=True)))
    table = pa.ipc.open_stream(pa.py_buffer(arrow_ipc)).read_all()
    if (
        table.schema.equals(MICROBATCH_SCHEMA)
        and table.num_rows == num_tokens
        and all(column.num_chunks == 1 for column in table.columns)
    ):  # the served layout, framed by another writer: one schema comparison instead of a
        # name, type and length check per column, which together cost more than the reads
        arrays = {
            name: column.chunk(0).to_numpy(zero_copy_only=True)
            for name, column in zip(MICROBATCH_SCHEMA.names, table.columns, strict=True)
        }
    else:
        arrays = _checked_columns(table, num_tokens)
    return _tensors(arrays)


def _tensors(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    import torch

    with warnings.catch_warnings():
        # The arrays view immutable message bytes; torch warns about that on every call.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {name: torch.from_numpy(array) for name, array in arrays.items()}


def _checked_columns(table: pa.Table, num_tokens: int) -> dict[str, np.ndarray]:
    """The MICROBATCH_SCHEMA columns of `table` by name, as numpy views; ValueError naming
    the first column that is missing, of another type or of another length."""
    arrays = {}
    for name, dtype in MICROBATCH_COLUMNS.items():
        if name not in table.column_names:
            raise ValueError(f"served microbatch lacks column {name!r}")
        column = table.column(name)
        if column.type != dtype:
            raise ValueError(f"served column {name!r} is {column.type}, expected {dtype}")
        chunk = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
        if len(chunk) != num_tokens:
            raise ValueError(f"served column {name!r} has {len(chunk)} rows, expected {num_tokens}")
        arrays[name] = chunk.to_numpy(zero_copy_only=True)
    return arrays


@dataclass(frozen=True)
class ServedMicrobatch:
    """A served `Microbatch`: `arrow_ipc` viewed in place, every other field in `fields`."""

    arrow_ipc: memoryview
    fields: pb.Microbatch  # arrow_ipc left empty

    def __getattr__(self, name: str):
        return getattr(self.fields, name)


@dataclass(frozen=True)
class ServedResponse:
    """A received `GetBatchResponse` whose Arrow payloads are views of the received bytes
    (the tensors decoded from it alias them); reads like the message: `.ready`, `.step`,
    ..., `.microbatches[i].arrow_ipc`."""

    header: pb.GetBatchResponse  # microbatches left empty
    microbatches: list[ServedMicrobatch]

    def __getattr__(self, name: str):
        return getattr(self.header, name)


def parse_get_batch_response(data: bytes) -> ServedResponse:
    """Serialized `GetBatchResponse` -> ServedResponse, without copying the Arrow payloads
    (the generated message would copy each twice). Same field values as FromString; input
    the in-place walk rejects goes through FromString (malformed bytes raise DecodeError)."""
    try:
        parts, rest = split_field(memoryview(data), 9)  # microbatches = 9
        microbatches = []
        for part in parts:
            payloads, fields = split_field(part, 1)  # Microbatch.arrow_ipc = 1
            arrow_ipc = payloads[-1] if payloads else memoryview(b"")
            microbatches.append(ServedMicrobatch(arrow_ipc, pb.Microbatch.FromString(fields)))
        return ServedResponse(pb.GetBatchResponse.FromString(rest), microbatches)
    except ValueError:
        message = pb.GetBatchResponse.FromString(data)
    microbatches = []
    for served in message.microbatches:
        fields = pb.Microbatch()
        fields.CopyFrom(served)
        fields.ClearField("arrow_ipc")
        microbatches.append(ServedMicrobatch(memoryview(served.arrow_ipc), fields))
    message.ClearField("microbatches")
    return ServedResponse(message, microbatches)


def decode_step(response: pb.GetBatchResponse | ServedResponse) -> list[MicrobatchTensors]:
    """A ready `GetBatchResponse` (or its in-place view) -> this rank's microbatches, in
    order."""
    import torch

    if not response.ready:
        raise ValueError(f"step {response.step} is not ready; nothing to decode")
    if len(response.microbatches) != response.microbatches_per_rank:
        raise ValueError(
            f"step {response.step} rank {response.rank}: {len(response.microbatches)} "
            f"microbatches served, microbatches_per_rank says {response.microbatches_per_rank}"
        )
    out = []
    for index, message in enumerate(response.microbatches):
        columns = _column_tensors(message.arrow_ipc, message.num_tokens)
        cu_seqlens = np.array(message.cu_seqlens or [0], dtype=np.int32)
        if cu_seqlens[-1] != message.num_tokens:
            raise ValueError(
                f"step {response.step} microbatch {index}: cu_seqlens ends at "
                f"{int(cu_seqlens[-1])}, num_tokens is {message.num_tokens}"
            )
        out.append(
            MicrobatchTensors(
                input_ids=columns["input_ids"],
                position_ids=columns["position_ids"],
                cu_seqlens=torch.from_numpy(cu_seqlens),
                max_seqlen=int(message.max_seqlen),
                target_ids=columns["target_ids"],
                loss_mask=columns["loss_mask"],
                sampler_logprobs=columns["sampler_logprobs"],
                advantages=columns["advantages"],
                rollout_ids=tuple(message.rollout_ids),
                policy_token_count=int(response.policy_token_count),
                microbatches_per_rank=int(response.microbatches_per_rank),
                policy_version=int(response.policy_version),
                step=int(response.step),
                index=index,
            )
        )
    return out
