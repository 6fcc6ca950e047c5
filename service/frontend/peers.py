"""The private peer service between the front-ends of one sidecar, and its client.

Calls: `GetPayload` (an ingest batch's columns by key, as one Arrow IPC stream),
`GetStoredResponse` (a rank's response of a stored step, the exact bytes served) and
`StepStored` (a step was stored there: ranks waiting elsewhere are forwarded to it).
Internal and versioned with the code: raw bytes through generic handlers, not part of
the public `rlfeed.proto` contract, on the peer port only. See `frontend/README.md`.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np
import pyarrow as pa
from rlfeed.client.auth import ChannelSecurity, open_channel
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.sched.assembly import TokenColumns

PEER_SERVICE = "rlfeed.internal.v1.FrontEndPeer"
_KEY = struct.Struct("<q")  # a batch key, or a step
_STEP_RANK = struct.Struct("<qq")
_PEER_CALL_SECONDS = 60.0
_ANNOUNCE_SECONDS = 5.0
_PEERS_REFRESH_SECONDS = 5.0
_COLUMNS_SCHEMA = pa.schema(
    [
        ("token_ids", pa.large_list(pa.int32())),
        ("action_mask", pa.large_list(pa.uint8())),
        ("sampler_logprobs", pa.large_list(pa.float32())),
    ]
)


def _timeout(caller_seconds: float | None) -> float:
    """A peer call never outlives its caller's deadline, nor _PEER_CALL_SECONDS."""
    if caller_seconds is None:
        return _PEER_CALL_SECONDS
    return max(min(caller_seconds, _PEER_CALL_SECONDS), 0.001)


def encode_columns(columns: TokenColumns) -> bytes:
    offsets = pa.array(np.asarray(columns.offsets, dtype=np.int64))
    batch = pa.RecordBatch.from_arrays(
        [
            pa.LargeListArray.from_arrays(offsets, pa.array(columns.token_ids)),
            pa.LargeListArray.from_arrays(offsets, pa.array(columns.action_mask)),
            pa.LargeListArray.from_arrays(offsets, pa.array(columns.sampler_logprobs)),
        ],
        schema=_COLUMNS_SCHEMA,
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, _COLUMNS_SCHEMA) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def decode_columns(data: bytes) -> TokenColumns:
    """The columns `encode_columns` wrote, as arrays viewing `data` (no copy)."""
    batch = pa.ipc.open_stream(pa.py_buffer(data)).read_next_batch()
    if batch.schema != _COLUMNS_SCHEMA:
        raise ValueError(f"peer payload has schema {batch.schema}, expected {_COLUMNS_SCHEMA}")
    tokens, mask, logprobs = (batch.column(i) for i in range(3))
    return TokenColumns(
        offsets=tokens.offsets.to_numpy(),
        token_ids=tokens.values.to_numpy(),
        action_mask=mask.values.to_numpy(),
        sampler_logprobs=logprobs.values.to_numpy(),
    )


def peer_handler(
    columns_of: Callable[[int], TokenColumns | None],
    response_of: Callable[[int, int], bytes | None],
    stored_elsewhere: Callable[[int, str], None],
) -> grpc.GenericRpcHandler:
    """The peer service over this front-end's memory: `columns_of(key)` and
    `response_of(step, rank)` return None for what it does not hold;
    `stored_elsewhere(step, frontend_id)` takes another front-end's announcement."""

    def get_payload(request: bytes, context) -> bytes:
        (key,) = _KEY.unpack(request)
        columns = columns_of(key)
        if columns is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"ingest batch {key} is not held here")
        return encode_columns(columns)

    def get_stored_response(request: bytes, context) -> bytes:
        step, rank = _STEP_RANK.unpack(request)
        response = response_of(step, rank)
        if response is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"step {step} is not held here")
        return response

    def step_stored(request: bytes, context) -> bytes:
        (step,) = _KEY.unpack_from(request)
        stored_elsewhere(step, request[_KEY.size :].decode())
        return b""

    return grpc.method_handlers_generic_handler(
        PEER_SERVICE,
        {
            "GetPayload": grpc.unary_unary_rpc_method_handler(get_payload),
            "GetStoredResponse": grpc.unary_unary_rpc_method_handler(get_stored_response),
            "StepStored": grpc.unary_unary_rpc_method_handler(step_stored),
        },
    )


class PeerClient:
    """Calls from front-end `own_id` to the others, by front-end id. Their addresses come
    from the scheduler actor (`addresses()`: id -> peer address of every registered
    front-end), asked again when an id is unknown or the list is older than
    `_PEERS_REFRESH_SECONDS`; one channel per peer, kept."""

    def __init__(
        self,
        own_id: str,
        addresses: Callable[[], dict[str, str]],
        max_message_bytes: int,
        *,
        peer_token: str = "",
    ) -> None:
        self._own_id = own_id
        self._security = ChannelSecurity(token=peer_token)
        self._addresses = addresses
        self._known: dict[str, str] = {}
        self._known_at = float("-inf")
        self._options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ]
        self._channels: dict[str, grpc.Channel] = {}
        self._announcing: set = set()  # StepStored calls in flight
        self._lock = threading.Lock()

    def _peers(self, refresh: bool = False) -> dict[str, str]:
        with self._lock:
            fresh = time.monotonic() - self._known_at < _PEERS_REFRESH_SECONDS
            if fresh and not refresh:
                return self._known
        known = self._addresses()
        with self._lock:
            self._known, self._known_at = known, time.monotonic()
        return known

    def others(self) -> list[str]:
        return [frontend_id for frontend_id in self._peers() if frontend_id != self._own_id]

    def _channel(self, frontend_id: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(frontend_id)
        if channel is not None:
            return channel
        address = self._peers().get(frontend_id) or self._peers(refresh=True).get(frontend_id)
        if address is None:
            raise RuntimeError(f"front-end {frontend_id} is not registered with the scheduler")
        channel = open_channel(address, self._security, self._options)
        with self._lock:
            kept = self._channels.setdefault(frontend_id, channel)
        if kept is not channel:
            channel.close()
        return kept

    def payload(self, frontend_id: str, key: int) -> TokenColumns:
        """The columns of another front-end's ingest batch (its planned step reads it, so
        it is held: an error here is a failure, and the step's materialization retries)."""
        call = self._channel(frontend_id).unary_unary(f"/{PEER_SERVICE}/GetPayload")
        return decode_columns(call(_KEY.pack(key), timeout=_PEER_CALL_SECONDS))

    def stored_response(
        self, frontend_id: str, step: int, rank: int, timeout_s: float | None
    ) -> bytes | None:
        """Another front-end's stored response bytes (it notes `rank` served), or None if
        it no longer holds the step (moved out to the object store meanwhile: ask the
        actor again). grpc.RpcError / RuntimeError if it cannot be reached."""
        call = self._channel(frontend_id).unary_unary(f"/{PEER_SERVICE}/GetStoredResponse")
        try:
            return call(_STEP_RANK.pack(step, rank), timeout=_timeout(timeout_s))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise

    def announce_stored(self, step: int) -> None:
        """Tell every other front-end that this one stored `step` (not waited for; a lost
        announcement only costs a waiting rank the actor's slower path)."""
        request = _KEY.pack(step) + self._own_id.encode()
        for frontend_id in self.others():
            try:
                call = self._channel(frontend_id).unary_unary(f"/{PEER_SERVICE}/StepStored")
                future = call.future(request, timeout=_ANNOUNCE_SECONDS)
            except (grpc.RpcError, RuntimeError):
                continue
            with self._lock:  # a future dropped before it completes cancels its call
                self._announcing.add(future)
            future.add_done_callback(self._announced)

    def _announced(self, future) -> None:
        with self._lock:
            self._announcing.discard(future)

    def forward_get_batch(
        self, frontend_id: str, request: pb.GetBatchRequest, timeout_s: float | None
    ) -> bytes:
        """The public GetBatch, asked of the front-end that stored the step (within the
        caller's `timeout_s`): its answer's bytes, unchanged. grpc.RpcError as that
        front-end answered (NOT_FOUND, ...); RuntimeError if it is not registered."""
        call = self._channel(frontend_id).unary_unary(
            "/rlfeed.v1.BatchServing/GetBatch",
            request_serializer=pb.GetBatchRequest.SerializeToString,
            response_deserializer=None,
        )
        return call(request, timeout=_timeout(timeout_s))

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()
